"""The offline API: ``LLM(...).generate(prompts)`` and ``.chat(messages)`` in one process."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.engine_config import EngineConfig
from engine.engine_core import LLMEngine
from engine.loaders.generation_defaults import GenerationDefaults, load_generation_defaults
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.loaders import LoadedModel

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """Offline batch generation (the aggregated path; also the oracle for the cluster's tokens).

    Keyword arguments are the fields of :class:`engine.engine_config.EngineConfig`, e.g.
    ``LLM(model="default", dtype="float32", device="cpu", page_size=16, num_pages=None,
    max_num_seqs=256, max_num_batched_tokens=2048, prefill_chunk_size=512, max_model_len=None,
    reuse_policy="all_reusable", seed=0)``, and ``generation_config``: "auto" (vLLM's default)
    samples without given params as the checkpoint's generation_config.json says
    (``get_default_sampling_params``), "none" with SamplingParams' defaults. Bad arguments raise
    ValueError naming the field.
    """

    def __init__(
        self, model: str = "default", generation_config: str = "auto", **kwargs: Any
    ) -> None:
        if generation_config not in ("auto", "none"):
            raise ValueError(
                f"generation_config must be 'auto' or 'none', got {generation_config!r}"
            )
        config = _engine_config(model, kwargs)
        self._defaults = GenerationDefaults()
        if generation_config == "auto":
            try:  # (before the engine: a bad file must not leave its ranks behind)
                self._defaults = load_generation_defaults(model, config.load_format)
            except FileNotFoundError:
                pass  # the engine says what is missing, in its words
        self.engine = LLMEngine.from_config(config)
        self._ids = itertools.count()

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, **kwargs: Any) -> LLM:
        """An LLM over an already loaded model (engine.loaders.load_model), with its own KV cache."""
        llm = cls.__new__(cls)
        llm.engine = LLMEngine.from_loaded(loaded, _engine_config(loaded.name, kwargs))
        llm._ids = itertools.count()
        llm._defaults = GenerationDefaults()  # (the checkpoint's path is not known here)
        return llm

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` sample with when given no params: SamplingParams'
        defaults, but where the checkpoint's generation_config.json sets temperature, top_p,
        top_k or max_new_tokens (as vLLM's LLM)."""
        return self._defaults.as_sampling_params()

    def close(self) -> None:
        """End the tensor-parallel ranks (``tensor_parallel_size`` > 1); the LLM is unusable after."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self):  # noqa: ANN201 (engine.tokenizer.Tokenizer | None)
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or a list of token ids); outputs in input order.

        Everything is validated before anything is queued, so a bad input raises ValueError and
        leaves the engine as it was.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]  # one text or one token-id prompt
        if not isinstance(prompts, Sequence) or not prompts:
            raise ValueError(
                "prompts must be a string, a list of token ids, or a non-empty list of those"
            )
        encoded = [self._encode(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        return self._run(encoded, sampling_params)

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or a list of
        conversations, rendered with the model's chat template."""
        if self.tokenizer is None:
            raise ValueError(
                "chat needs a tokenizer, and this model has none; use generate with token ids"
            )
        if not isinstance(messages, Sequence) or not messages:
            raise ValueError("messages must be a non-empty list of messages or of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        encoded: list[tuple[str | None, list[int]]] = []
        for i, conv in enumerate(conversations):
            if not isinstance(conv, list) or not conv or not all(isinstance(m, dict) for m in conv):
                raise ValueError(f"messages[{i}] must be a non-empty list of message dicts")
            text = self.tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt
            )
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            self.engine.check_prompt(ids, f"messages[{i}]")
            encoded.append((text, ids))
        return self._run(encoded, sampling_params)

    # ---- internals ----
    def _encode(self, prompt: object, what: str) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{what}: the prompt is empty")
            if self.tokenizer is None:
                raise ValueError(
                    f"{what}: this model has no tokenizer; pass token ids instead of text"
                )
            ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        elif isinstance(prompt, list):
            ids, text = prompt, None
        else:
            raise ValueError(
                f"{what}: expected a string or a list of token ids, got {type(prompt).__name__}"
            )
        self.engine.check_prompt(ids, what)
        return text, list(ids)

    def _params(self, sampling_params: object, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str):
            params = list(sampling_params)
            if len(params) != n:
                raise ValueError(
                    f"sampling_params has {len(params)} entries for {n} prompts; give one per prompt"
                )
            for i, p in enumerate(params):
                if not isinstance(p, SamplingParams):
                    raise ValueError(
                        f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}"
                    )
            return params
        raise ValueError(
            f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}"
        )

    def _run(
        self, encoded: list[tuple[str | None, list[int]]], sampling_params: object
    ) -> list[RequestOutput]:
        params = self._params(sampling_params, len(encoded))
        ids = [f"llm-{next(self._ids)}" for _ in encoded]
        requests = [
            self.engine.make_request(rid, tokens, p, prompt=text)
            for rid, (text, tokens), p in zip(ids, encoded, params, strict=True)
        ]
        ours = set(ids)
        results: dict[str, RequestOutput] = {}
        try:
            for request in requests:
                self.engine.scheduler.add_request(request)
            while len(results) < len(ids):
                if not self.engine.has_unfinished():
                    raise RuntimeError(
                        f"engine stopped with {len(ids) - len(results)} of this call's requests unfinished"
                    )
                outputs = self.engine.step()
                for out in outputs:
                    if out.finished and out.request_id in ours:
                        results[out.request_id] = out
                if not outputs and self.engine.scheduler.num_running == 0:
                    # Offline, nothing else holds pages: an idle step with requests waiting is a bug.
                    raise RuntimeError("no request could be scheduled; the engine made no progress")
        except BaseException:
            for rid in ids:
                if rid not in results:
                    self.engine.abort_request(rid)
            raise
        return [results[rid] for rid in ids]


def _engine_config(model: str, kwargs: dict[str, Any]) -> EngineConfig:
    unknown = set(kwargs) - set(EngineConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(
            f"unknown LLM arguments {sorted(unknown)}; expected some of {sorted(EngineConfig.__dataclass_fields__)}"
        )
    return EngineConfig(model=model, **kwargs)
