"""One request's life inside the engine: its tokens, progress, status and timestamps."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch

from engine.logprobs import TokenLogprobs
from engine.sampling_params import SamplingParams
from kvcache.manager import NO_RELEASE

FinishReason = Literal["stop", "length", "abort"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, its pages freed, to be recomputed
    PREFILLED = "prefilled"  # prefill-only request: first token sampled, pages kept for a transfer
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = (
        "finished_error"  # can never be served (e.g. needs more pages than the pool has)
    )

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "abort",
}


@dataclass
class RequestMetrics:
    """Timestamps (``time.time()`` seconds, so that P and D timings can be joined) and counts."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    num_cached_host_tokens: int = 0  # of those, the ones loaded back from the KV host tier
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first: (last - first) / (n - 1)."""
        if (
            self.first_token_time is None
            or self.last_token_time is None
            or self.num_output_tokens < 2
        ):
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)


class Request:
    """A prompt and its generated tokens, as the scheduler tracks them.

    ``all_token_ids`` is prompt + output; the KV of its first ``num_computed_tokens`` tokens is in
    the request's pages. The newest output token has no KV yet: the next step computes it. After a
    preemption ``num_computed_tokens`` drops to 0 and prompt + output are recomputed (outputs kept).
    ``page_ids`` caches the request's page lists per KV pool group (kvcache's ``page_ids``), with
    ``kv_capacity`` (tokens they cover) and ``kv_release_at`` (computed tokens from which a window
    group would release a page), refreshed by the scheduler after each allocation.
    """

    __slots__ = (
        "request_id", "prompt", "prompt_token_ids", "sampling_params", "eos_token_ids", "eos_token_id",
        "min_tokens_masked", "penalized", "prompt_token_set", "logprobs", "next_logprobs",
        "prompt_logprobs", "wants_prompt_logits", "logit_bias", "allowed_token_ids", "allowed_ids_tensor",
        "all_token_ids", "output_token_ids", "num_computed_tokens", "status", "stop_reason",
        "error", "prefill_only", "metrics", "page_ids", "kv_capacity", "kv_release_at",
        "detokenizer", "output_text",
        "num_text_sent", "num_tokens_sent", "generator", "committed_pages", "committed_prompt",
        "stats_recorded", "token_gaps", "last_sampled_time",
    )  # fmt: skip

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        prompt: str | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
        eos_token_id: int | None = None,
        prefill_only: bool = False,
        arrival_time: float | None = None,
        detokenizer: Any = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must not be empty")
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        # EOS only stops a request that does not ignore it; resolved once here, not every step.
        self.eos_token_ids = frozenset() if sampling_params.ignore_eos else frozenset(eos_token_ids)
        # What min_tokens masks: every EOS id (ignored or not, as vLLM) and the stop token ids.
        self.min_tokens_masked: tuple[int, ...] = (
            tuple(sorted(set(eos_token_ids) | set(sampling_params.stop_token_ids)))
            if sampling_params.min_tokens
            else ()
        )
        self.penalized = sampling_params.penalized  # (read per row and step by the sampler)
        # (token ids, their biases): read per row and step by the sampler
        bias = sampling_params.logit_bias
        self.logit_bias = (list(bias), list(bias.values())) if bias else None
        self.allowed_token_ids = sampling_params.allowed_token_ids  # (None: all)
        self.allowed_ids_tensor: torch.Tensor | None = None  # (the sampler's, made once)
        self.prompt_token_set: torch.Tensor | None = None  # (engine/penalties.py keeps it)
        # One TokenLogprobs per output token when the request asks for them (else None); the
        # sampler (or the caller, for a token sampled elsewhere) sets ``next_logprobs`` for the
        # token appended next.
        self.logprobs: list[TokenLogprobs] | None = None if sampling_params.logprobs is None else []
        self.next_logprobs: TokenLogprobs | None = None
        # With prompt_logprobs: one entry per prompt token, the first None (nothing comes before
        # it), filled chunk by chunk as the prompt is computed (engine/prompt_logprobs.py), then a
        # tuple that every output shares. ``wants_prompt_logits`` until it is whole: the request
        # then reads nothing from the prefix cache (a cached position has no logits).
        asked = sampling_params.prompt_logprobs is not None
        self.wants_prompt_logits = asked and len(prompt_token_ids) > 1
        self.prompt_logprobs: (
            list[TokenLogprobs | None] | tuple[TokenLogprobs | None, ...] | None
        ) = [None] if self.wants_prompt_logits else (None,) if asked else None
        self.eos_token_id = eos_token_id  # of those, the tokenizer's (stop_reason None)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None  # the stop token id or stop string that matched
        self.error: str | None = None
        self.prefill_only = prefill_only
        self.metrics = RequestMetrics(
            arrival_time=time.time() if arrival_time is None else arrival_time,
            num_prompt_tokens=len(prompt_token_ids),
        )
        self.page_ids: dict[str, list[int]] = {}
        self.kv_capacity = 0
        self.kv_release_at = NO_RELEASE
        self.detokenizer = detokenizer  # IncrementalDetokenizer, or None (token ids only)
        self.output_text = ""
        self.num_text_sent = 0  # characters of output_text already streamed
        self.num_tokens_sent = 0  # output tokens already streamed
        self.generator: torch.Generator | None = None  # per-request RNG, created on first sample
        self.committed_pages = 0  # full pages passed to kv.commit so far (skip no-op commits)
        self.committed_prompt = False
        self.stats_recorded = False  # its RequestStats were buffered (once per request)
        # Gaps between consecutive tokens this engine sampled (a first token injected by
        # add_prefilled_request was sampled elsewhere: it starts no gap).
        self.token_gaps: list[float] = []
        self.last_sampled_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    def took_prompt_elsewhere(self) -> None:
        """The prompt was computed by another worker (prefill and decode apart): its prompt
        logprobs, if asked, went with the first token from there; none are made here."""
        self.prompt_logprobs = None
        self.wants_prompt_logits = False

    def append_output_token(self, token_id: int, now: float, sampled_here: bool = True) -> None:
        """Add a generated token; ``sampled_here`` is False for a first token sampled by another
        worker (it does not start a token gap of this engine)."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.logprobs is not None:
            entry, self.next_logprobs = self.next_logprobs, None
            if entry is None or entry.token_id != token_id:
                raise RuntimeError(
                    f"request {self.request_id!r}: token {token_id} came without its logprobs"
                )
            self.logprobs.append(entry)
        m = self.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        m.num_output_tokens = len(self.output_token_ids)
        if sampled_here:
            if self.last_sampled_time is not None:
                self.token_gaps.append(now - self.last_sampled_time)
            self.last_sampled_time = now

    def reset_for_recompute(self) -> None:
        """Forget all KV progress (pages are freed by the caller); outputs are kept."""
        self.num_computed_tokens = 0
        self.page_ids = {}
        self.kv_capacity = 0
        self.kv_release_at = NO_RELEASE
        self.committed_pages = 0
        self.committed_prompt = False

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
