"""The offline API: ``LLM(...).generate(prompts)`` and ``.chat(messages)`` in one process."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from engine.engine_core import LLMEngine
from engine.hf_tokenizer_view import HFTokenizerView
from engine.llm_arguments import engine_config_of
from engine.loaders.generation_defaults import GenerationDefaults, load_generation_defaults
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams, last_prompt_tokens

if TYPE_CHECKING:
    from engine.loaders import LoadedModel

log = logging.getLogger(__name__)

# A prompt: text, token ids, or vLLM's TextPrompt / TokensPrompt dicts.
Prompt = str | list[int] | Mapping[str, Any]
Message = dict[str, Any]
# vLLM's progress option: a bool, or a tqdm-like class to make the bar with.
Progress = bool | Callable[..., tqdm]


class LLM:
    """Offline batch generation (the aggregated path; also the oracle for the cluster's tokens).

    Keyword arguments are the fields of :class:`engine.engine_config.EngineConfig`, e.g.
    ``LLM(model="default", dtype="float32", device=<"cuda" where a GPU is visible, as vLLM picks
    its platform, else "cpu">, page_size=16, num_pages=None,
    max_num_seqs=256, max_num_batched_tokens=2048, prefill_chunk_size=512, max_model_len=None,
    reuse_policy="all_reusable", seed=0)``, and ``generation_config``: "auto" (vLLM's default)
    samples without given params as the checkpoint's generation_config.json says
    (``get_default_sampling_params``), "none" (or vLLM's "vllm") with SamplingParams' defaults.
    vLLM's names are taken too: ``enable_prefix_caching`` (reuse_policy), ``enforce_eager`` (no
    CUDA graphs), ``block_size`` (page_size), ``gpu_memory_utilization`` (its meaning, not
    gpu_memory_fraction's), ``dtype`` "auto", "half" or a torch dtype, ``trust_remote_code``
    (no checkpoint code ever runs), ``tokenizer`` (the checkpoint's own only),
    ``kv_cache_dtype="auto"`` and ``quantization=None``. Bad arguments raise ValueError naming
    the field.
    """

    def __init__(
        self, model: str = "default", generation_config: str = "auto", **kwargs: Any
    ) -> None:
        if generation_config not in ("auto", "none", "vllm"):
            raise ValueError(
                f"generation_config must be 'auto' or 'none' ('vllm'), got {generation_config!r}"
            )
        config = engine_config_of(model, kwargs)
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
        llm.engine = LLMEngine.from_loaded(loaded, engine_config_of(loaded.name, kwargs))
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

    def get_tokenizer(self) -> HFTokenizerView | None:
        """The model's tokenizer as vLLM hands it out: called as transformers' tokenizers are
        (engine/hf_tokenizer_view.py); None for a model without one. ``LLM.tokenizer`` is the
        engine's own."""
        if self.tokenizer is None:
            return None
        return HFTokenizerView(self.tokenizer)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: Progress = True,
        lora_request: None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, a list of token ids, or vLLM's ``{"prompt": text}`` /
        ``{"prompt_token_ids": ids}``); outputs in input order (none for no prompts).
        ``use_tqdm``: a progress bar of finished requests (True, or a tqdm-like class), as vLLM's.
        ``lora_request`` and ``priority`` are taken, in vLLM's places, only where they ask for
        nothing (None; all priorities 0): Duet has no LoRA adapters and one queue order.
        A prompt whose params ask ``n`` > 1 completions gets one output with all of them in
        ``outputs`` (each a request of its own; see SamplingParams.n).

        Everything is validated before anything is queued, so a bad input raises ValueError and
        leaves the engine as it was.
        """
        if (
            isinstance(prompts, (str, Mapping))
            or isinstance(prompts, list)
            and prompts
            and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]  # one prompt
        if not isinstance(prompts, Sequence):
            raise ValueError(
                "prompts must be a string, a list of token ids, a prompt dict, or a list of those"
            )
        _refuse_lora(lora_request)
        if priority is not None and any(priority):
            raise ValueError("priority: Duet serves requests in arrival order (give None or 0s)")
        encoded = [self._encode(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        return self._run(encoded, sampling_params, use_tqdm)

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: Progress = True,
        lora_request: None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts; a content
        may be OpenAI's list of text parts) or a list of conversations, rendered with the model's
        chat template, or ``chat_template``; ``chat_template_kwargs`` and ``tools`` become
        template variables. ``continue_final_message`` (with ``add_generation_prompt=False``)
        continues the last message instead of opening a new one. The arguments and their order
        are vLLM's (``lora_request`` only None); ``chat_template_content_format`` is vLLM's
        ("auto", "string" or "openai": engine.chat_template.render_chat_template)."""
        _refuse_lora(lora_request)
        if self.tokenizer is None:
            raise ValueError(
                "chat needs a tokenizer, and this model has none; use generate with token ids"
            )
        if not isinstance(messages, Sequence) or not messages:
            raise ValueError("messages must be a non-empty list of messages or of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        options = dict(chat_template_kwargs or {})
        if tools is not None:
            options["tools"] = tools
        encoded: list[tuple[str | None, list[int], str]] = []
        for i, conv in enumerate(conversations):
            if not isinstance(conv, list) or not conv or not all(isinstance(m, dict) for m in conv):
                raise ValueError(f"messages[{i}] must be a non-empty list of message dicts")
            text = self.tokenizer.apply_chat_template(
                conv,
                add_generation_prompt,
                chat_template=chat_template,
                continue_final_message=continue_final_message,
                variables=options,
                content_format=chat_template_content_format,
            )
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            encoded.append((text, ids, f"messages[{i}]"))
        return self._run(encoded, sampling_params, use_tqdm)

    # ---- internals ----
    def _encode(self, prompt: object, what: str) -> tuple[str | None, list[int], str]:
        if isinstance(prompt, Mapping):
            prompt = _prompt_of(prompt, what)
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
                f"{what}: expected a string, a list of token ids or a prompt dict, "
                f"got {type(prompt).__name__}"
            )
        return text, list(ids), what

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
        self,
        encoded: list[tuple[str | None, list[int], str]],
        sampling_params: object,
        use_tqdm: Progress = False,
    ) -> list[RequestOutput]:
        """Run the prompts (text, token ids, what an error calls the prompt), each with its params,
        checked all before any is queued."""
        params = self._params(sampling_params, len(encoded))
        if not encoded:
            return []
        prompts = []
        for (text, tokens, what), p in zip(encoded, params, strict=True):
            tokens = last_prompt_tokens(tokens, p.truncate_prompt_tokens, self.engine.max_model_len)
            self.engine.check_prompt(tokens, what)
            prompts.append((text, tokens))
        groups: list[tuple[str, list[str]]] = []  # (a prompt's id, its completions' request ids)
        requests = []
        for (text, tokens), p in zip(prompts, params, strict=True):
            pid = f"llm-{next(self._ids)}"
            rids = [pid] if p.n == 1 else [f"{pid}-{i}" for i in range(p.n)]
            for i, rid in enumerate(rids):
                choice = p if p.n == 1 else p.for_choice(i)  # (one output, one prompt_logprobs)
                requests.append(self.engine.make_request(rid, tokens, choice, prompt=text))
            groups.append((pid, rids))
        ids = [r.request_id for r in requests]
        ours = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = _progress(use_tqdm, len(ids))
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
                        if bar is not None:
                            bar.update(1)
                if not outputs and self.engine.scheduler.num_running == 0:
                    # Offline, nothing else holds pages: an idle step with requests waiting is a bug.
                    raise RuntimeError("no request could be scheduled; the engine made no progress")
        except BaseException:
            for rid in ids:
                if rid not in results:
                    self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        decode = self._token_text
        return [
            results[rids[0]].with_token_texts(decode)
            if len(rids) == 1
            else RequestOutput.of_choices(pid, [results[rid] for rid in rids], decode)
            for pid, rids in groups
        ]

    def _token_text(self, token_id: int) -> str:
        """A logprobs entry's token as text (vLLM's decoded_token); "" without a tokenizer."""
        tokenizer = self.engine.tokenizer
        return tokenizer.token_text(token_id) if tokenizer is not None else ""


def _refuse_lora(lora_request: object) -> None:
    if lora_request is not None:
        raise ValueError("lora_request: Duet serves no LoRA adapters (give None)")


def _prompt_of(prompt: Mapping[str, Any], what: str) -> str | list[int]:
    """The text or token ids of vLLM's TextPrompt ({"prompt"}: a str) or TokensPrompt
    ({"prompt_token_ids"}: a list of ints); any other key (images, cache salts, ...) is refused
    by name, and so is a value of the other kind (text under prompt_token_ids would otherwise be
    tokenized again, special tokens and all)."""
    keys = set(prompt)
    if keys == {"prompt"}:
        if not isinstance(prompt["prompt"], str):
            raise ValueError(f"{what}: 'prompt' must be a string (token ids: 'prompt_token_ids')")
        return prompt["prompt"]
    if keys == {"prompt_token_ids"}:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, list):
            raise ValueError(
                f"{what}: 'prompt_token_ids' must be a list of token ids, got "
                f"{type(ids).__name__} (text: 'prompt')"
            )
        return ids
    other = sorted(keys - {"prompt", "prompt_token_ids"})
    raise ValueError(
        f"{what}: a prompt dict has one of 'prompt' or 'prompt_token_ids'"
        + (f"; not supported: {other}" if other else f", got {sorted(keys)}")
    )


def _progress(use_tqdm: Progress, total: int) -> tqdm | None:
    if use_tqdm is False:
        return None
    make = tqdm if use_tqdm is True else use_tqdm
    if not callable(make):
        raise ValueError(f"use_tqdm must be a bool or a tqdm-like class, got {use_tqdm!r}")
    return make(total=total, desc="Processed prompts", dynamic_ncols=True)
