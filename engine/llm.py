"""The offline API: ``LLM(...).generate(prompts)`` and ``.chat(messages)`` in one process."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from engine.engine_core import LLMEngine
from engine.hf_tokenizer_view import HFTokenizerView
from engine.llm_arguments import engine_config_of
from engine.loaders.generation_defaults import GenerationDefaults, load_generation_defaults
from engine.logprobs import Logprob
from engine.offline_prompts import EncodedPrompt, Prompt, encode_prompts
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams, last_prompt_tokens
from engine.vllm_engine_view import VLLMEngineView

if TYPE_CHECKING:
    from engine.loaders import LoadedModel

log = logging.getLogger(__name__)

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
        top_k, min_p, a penalty (repetition, presence, frequency) or max_new_tokens (as vLLM's
        LLM)."""
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

    @property
    def llm_engine(self) -> VLLMEngineView:
        """vLLM's ``llm.llm_engine`` for what scripts read through it: ``get_tokenizer()``,
        ``tokenizer``, ``model_config.max_model_len`` and a few more
        (engine/vllm_engine_view.py); anything else is refused, naming ``llm.engine``."""
        return VLLMEngineView(self.engine)

    def get_tokenizer(self) -> HFTokenizerView | None:
        """The model's tokenizer as vLLM hands it out: called as transformers' tokenizers are
        (engine/hf_tokenizer_view.py); None for a model without one. ``LLM.tokenizer`` is the
        engine's own."""
        if self.tokenizer is None:
            return None
        return HFTokenizerView(self.tokenizer)

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Forget every cached prefix page, so that no later prompt reads KV computed before
        (vLLM's: after new weights, or to measure a cold cache); True once done. vLLM refuses
        (False) while requests hold pages unless ``reset_running_requests`` preempts them; this
        LLM's calls return only when their requests have finished, so none holds pages here and
        the reset always happens. ``reset_connector``: also the host tier's pages (Duet's
        counterpart of vLLM's KV offloading connector, whose cache vLLM clears only when asked)."""
        for name, value in (
            ("reset_running_requests", reset_running_requests),
            ("reset_connector", reset_connector),
        ):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")
        return self.engine.reset_prefix_cache(host_tier=reset_connector)

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
        _refuse_lora(lora_request)
        if priority is not None and any(priority):
            raise ValueError("priority: Duet serves requests in arrival order (give None or 0s)")
        return self._run(encode_prompts(prompts, self.tokenizer), sampling_params, use_tqdm)

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        lora_request: None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (engine/beam_search.py): per prompt (as ``generate`` takes them) its
        ``params.beam_width`` best sequences, best first. Each step runs every live beam as a
        one-token request of this engine (the prefix cache serves the beams' shared prefixes);
        ``concurrency_limit`` prompts are searched at once (None: all); ``use_tqdm``: a bar of
        token steps."""
        _refuse_lora(lora_request)
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if not isinstance(use_tqdm, bool):
            raise ValueError(f"use_tqdm must be a bool, got {use_tqdm!r}")
        limit = concurrency_limit
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 1
        ):
            raise ValueError(f"concurrency_limit must be None or an integer >= 1, got {limit!r}")
        tokenizer = self.tokenizer
        if tokenizer is None:  # (its EOS ends beams, and it writes their text)
            raise ValueError("beam_search needs the model's tokenizer, and this model has none")
        encoded = encode_prompts(prompts, self.tokenizer)
        for _, tokens, what in encoded:
            self.engine.check_prompt(tokens, what)
        one_token = SamplingParams(
            max_tokens=1,
            logprobs=2 * params.beam_width,
            temperature=params.temperature,
            detokenize=False,  # (the candidates' ids and logprobs are all a step needs)
        )

        def step(beams: list[list[int]]) -> list[dict[int, Logprob]]:
            outs = self._run([(None, b, "beam") for b in beams], one_token)
            return [out.outputs[0].logprobs[0] for out in outs]  # type: ignore[index]

        num_batches = -(-len(encoded) // (limit or max(len(encoded), 1)))
        bar = tqdm(total=params.max_tokens * num_batches, desc="Beam search") if use_tqdm else None
        try:
            return beam_search(
                [tokens for _, tokens, _ in encoded],
                params,
                step,
                eos_token_id=tokenizer.eos_token_id,
                max_model_len=self.engine.max_model_len,
                decode=tokenizer.decode,
                concurrency_limit=limit,
                on_step=None if bar is None else lambda: bar.update(1),
            )
        finally:
            if bar is not None:
                bar.close()

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
        encoded: list[EncodedPrompt] = []
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
        encoded: list[EncodedPrompt],
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
            pid = str(next(self._ids))  # (vLLM's: "0", "1", ...; scripts sort by int(id))
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
        outputs = []
        for (pid, rids), p in zip(groups, params, strict=True):
            # (vLLM names the logprobs' tokens only for a request it detokenizes)
            decode = self._token_text if p.detokenize else None
            outputs.append(
                results[rids[0]].with_token_texts(decode)
                if len(rids) == 1
                else RequestOutput.of_choices(pid, [results[rid] for rid in rids], decode)
            )
        return outputs

    def _token_text(self, token_id: int) -> str:
        """A logprobs entry's token as text (vLLM's decoded_token); "" without a tokenizer."""
        tokenizer = self.engine.tokenizer
        return tokenizer.token_text(token_id) if tokenizer is not None else ""


def _refuse_lora(lora_request: object) -> None:
    if lora_request is not None:
        raise ValueError("lora_request: Duet serves no LoRA adapters (give None)")


def _progress(use_tqdm: Progress, total: int) -> tqdm | None:
    if use_tqdm is False:
        return None
    make = tqdm if use_tqdm is True else use_tqdm
    if not callable(make):
        raise ValueError(f"use_tqdm must be a bool or a tqdm-like class, got {use_tqdm!r}")
    return make(total=total, desc="Processed prompts", dynamic_ncols=True)
