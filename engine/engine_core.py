"""LLMEngine: requests in, one step at a time, RequestOutputs (with streaming deltas) out.

The step loop: schedule -> build the batch -> forward + sample -> update the requests -> outputs and
stats. Single-threaded; only the stats buffers may be drained from another thread.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from engine.batch_builder import BatchBuilder
from engine.detokenizer import IncrementalDetokenizer
from engine.engine_build import engine_from_config, engine_from_loaded
from engine.engine_config import EngineConfig
from engine.logprobs import TokenLogprobs
from engine.model_config import ModelConfig
from engine.outputs import RequestOutput
from engine.prompt_logprobs import plan_prompt_logits, slice_rows
from engine.request import Request, RequestStatus
from engine.runner import ModelRunner, PagedCausalLM
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_config import SchedulerConfig
from engine.stats import IterationStats, RequestStats, StatsBuffer
from engine.tokenizer import Tokenizer
from engine.tp.context import TPContext
from engine.tp.local_ranks import Ranks, StartRanks, stop_after_failed_step
from engine.warm_up import warm_up
from kvcache.manager import KVCacheManager
from kvcache.sizing import CudaMemory

if TYPE_CHECKING:
    from engine.loaders import LoadedModel

log = logging.getLogger(__name__)


class LLMEngine:
    """One model, one paged KV cache, one scheduler."""

    def __init__(
        self,
        model: PagedCausalLM,
        model_config: ModelConfig,
        kv: KVCacheManager,
        scheduler_config: SchedulerConfig,
        *,
        tokenizer: Tokenizer | None = None,
        seed: int = 0,
        max_stats_len: int = 1000,
        max_request_stats_len: int | None = None,
        model_name: str = "",
        model_fingerprint: str = "",
        cuda_graphs: bool = False,
        tp: TPContext | None = None,
    ) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.kv = kv
        self.model_name = model_name
        self.model_fingerprint = model_fingerprint  # (which weights: engine/loaders/fingerprint.py)
        self.scheduler = Scheduler(scheduler_config, kv)
        self.builder = BatchBuilder(
            scheduler_config.page_size,
            scheduler_config.max_pages_per_seq,
            kv.device,
            list(kv.specs),
        )
        self.tp = tp
        # ranks 1.. of a tensor-parallel engine (close() ends them)
        self.local_ranks: Ranks | None = None
        self.runner = ModelRunner(
            model,
            kv,
            model_config.num_layers,
            Sampler(seed, kv.device),
            tp.group if tp is not None and tp.size > 1 else None,
            slice_rows(model_config.vocab_size, scheduler_config.max_num_seqs),
        )
        # Graph capture of the all-reduces is not done yet: tensor-parallel steps run eagerly.
        if cuda_graphs and kv.device.type == "cuda":
            if tp is None or tp.size == 1:
                self.runner.capture_cuda_graphs(
                    scheduler_config.max_num_seqs, scheduler_config.max_pages_per_seq
                )
            elif tp.partition.rank == 0:
                log.info(
                    "no CUDA graphs with tensor_parallel_size %d: decode steps run eagerly", tp.size
                )
        stop_ids = set(model_config.eos_token_ids) | set(
            tokenizer.stop_token_ids if tokenizer else ()
        )
        self.eos_token_ids: frozenset[int] = frozenset(stop_ids)
        # The one EOS that stops with no stop_reason; the others (generation_config's end-of-turn
        # ids) stop as stop tokens, naming their id, as in vLLM.
        self.eos_token_id = tokenizer.eos_token_id if tokenizer else None
        self.iteration_stats: StatsBuffer[IterationStats] = StatsBuffer(max_stats_len)
        self.request_stats: StatsBuffer[RequestStats] = StatsBuffer(
            max_stats_len if max_request_stats_len is None else max_request_stats_len
        )
        self.num_iterations = 0

    @classmethod
    def from_config(cls, config: EngineConfig, start_ranks: StartRanks | None = None) -> LLMEngine:
        """Load the model, size the KV cache and build the engine (engine/engine_build.py). Bad
        sources raise ValueError.

        With ``tensor_parallel_size`` > 1 this process is rank 0; ``start_ranks(config, size)``
        starts the others (default: local processes, engine/tp/local_ranks.py; the cluster's
        workers start Ray actors instead, worker_common/tp_ranks.py)."""
        return engine_from_config(cls, config, start_ranks)

    def close(self) -> None:
        """End the offline API's tensor-parallel ranks (nothing to do without them)."""
        if self.local_ranks is not None:
            ranks, self.local_ranks = self.local_ranks, None
            ranks.close()

    @classmethod
    def from_loaded(
        cls,
        loaded: LoadedModel,
        config: EngineConfig,
        tp: TPContext | None = None,
        memory_at_start: CudaMemory | None = None,
    ) -> LLMEngine:
        """An engine over an already loaded model (its fields model/load_format/dtype are not used
        again; several engines may share one model, each with its own KV cache). With ``tp`` this
        is rank 0 of a tensor-parallel worker: its KV pools hold its head shard, and the other
        ranks get the page counts (TPSetup) once they are sized. The KV cache goes on the
        model's device, whatever ``config.device`` says (a model loaded on a GPU next to a KV
        cache in host memory cannot run). ``memory_at_start``: the device before the model was
        loaded, so that gpu_memory_utilization counts what loading took outside torch."""
        return engine_from_loaded(cls, loaded, config, tp, memory_at_start)

    def warm_up(self) -> None:
        """One request through prefill and a decode step, then forgotten (engine/warm_up.py)."""
        warm_up(self)

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    # ---- requests ----
    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        prompt: str | None = None,
        prefill_only: bool = False,
        arrival_time: float | None = None,
    ) -> Request:
        """A validated Request (not yet queued). Raises ValueError naming what is wrong."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}"
            )
        params = params.copy()  # (the caller's may change later: vLLM's are mutable, so ours)
        self.check_prompt(prompt_token_ids, f"request {request_id!r}")
        if params.n != 1:
            raise ValueError(
                f"request {request_id!r}: one engine request is one completion (n=1); "
                f"engine.LLM makes the n={params.n} completions as n requests"
            )
        vocab = self.model_config.vocab_size
        for name, ids in (
            ("logit_bias", params.logit_bias or {}),
            ("allowed_token_ids", params.allowed_token_ids or ()),
        ):
            beyond = [t for t in ids if t >= vocab]
            if beyond:  # (the step would fail on them, for every request of its batch)
                raise ValueError(
                    f"request {request_id!r}: {name} has token ids {beyond[:5]} outside the "
                    f"vocabulary [0, {vocab})"
                )
        if params.stop and self.tokenizer is None:  # (they would never match: no text is made)
            raise ValueError(
                f"request {request_id!r}: stop strings need the model's tokenizer, and this model "
                "has none (random weights): use stop_token_ids"
            )
        detok = None
        if self.tokenizer is not None and params.detokenize:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                params.skip_special_tokens,
                params.spaces_between_special_tokens,
            )
        return Request(
            request_id,
            prompt_token_ids,
            params,
            prompt=prompt,
            eos_token_ids=self.eos_token_ids,
            eos_token_id=self.eos_token_id,
            prefill_only=prefill_only,
            arrival_time=arrival_time,
            detokenizer=detok,
        )

    def check_prompt(self, token_ids: list[int], what: str) -> None:
        """Raise ValueError unless ``token_ids`` is a non-empty list of in-vocabulary ids that leaves
        room for one output token within max_model_len (vLLM's rule)."""
        if not isinstance(token_ids, list) or not token_ids:
            raise ValueError(f"{what}: the prompt is empty (need at least one token)")
        vocab = self.model_config.vocab_size
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(
                    f"{what}: token id {t!r} is not an integer in [0, vocab_size={vocab})"
                )
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"{what}: the prompt has {len(token_ids)} tokens; with at least one output token "
                f"that is more than max_model_len={self.max_model_len}"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        prompt: str | None = None,
        prefill_only: bool = False,
        arrival_time: float | None = None,
    ) -> Request:
        """Queue a request. ``prefill_only``: stop after the first token and keep the pages (the
        prefill worker's mode) until ``release(request_id)``."""
        request = self.make_request(
            request_id,
            prompt_token_ids,
            params,
            prompt=prompt,
            prefill_only=prefill_only,
            arrival_time=arrival_time,
        )
        self.scheduler.add_request(request)
        return request

    def add_prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token_id: int,
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        first_text_sent: int,
        num_cached_tokens: int = 0,
        num_cached_host_tokens: int = 0,
        first_logprobs: TokenLogprobs | None = None,
    ) -> Request:
        """Start decoding a request whose prompt KV the caller already placed in ``self.kv`` (pages
        allocated under ``request_id``); the first token was produced and streamed elsewhere.
        ``num_cached_tokens``: how much of the prompt the caller found in this engine's own prefix
        cache (the rest came from elsewhere), ``num_cached_host_tokens`` of it from the host tier,
        for the request's stats. ``first_text_sent``: the characters of the first token's text the
        prefill side streamed (PrefillResult.first_token_text); it holds back the end that a stop
        string could still claim, which this side streams or drops. ``first_logprobs``: the first
        token's (PrefillResult.first_token_logprobs), when the request asks for logprobs."""
        request = self.make_request(request_id, prompt_token_ids, params, arrival_time=arrival_time)
        _take_first_logprobs(request, first_token_id, first_logprobs)
        request.took_prompt_elsewhere()
        request.metrics.num_cached_tokens = num_cached_tokens
        request.metrics.num_cached_host_tokens = num_cached_host_tokens
        self.scheduler.add_prefilled_request(request, first_token_id)
        self._sent_elsewhere(request, first_text_sent)
        if request.is_finished:
            self._record_finished(request)
        return request

    def add_recomputed_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token_id: int,
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        first_text_sent: int,
        first_logprobs: TokenLogprobs | None = None,
    ) -> Request:
        """Queue a prefilled request whose KV never arrived (transfer.on_failure: recompute): its
        prompt and the first token (sampled and streamed elsewhere) are computed here, as a
        preempted request is recomputed, and decoding goes on from there. ``first_text_sent`` and
        ``first_logprobs`` as for add_prefilled_request."""
        request = self.make_request(request_id, prompt_token_ids, params, arrival_time=arrival_time)
        _take_first_logprobs(request, first_token_id, first_logprobs)
        request.took_prompt_elsewhere()
        self.scheduler.add_recomputed_request(request, first_token_id)
        self._sent_elsewhere(request, first_text_sent)
        if request.is_finished:
            self._record_finished(request)
        return request

    def _sent_elsewhere(self, request: Request, first_text_sent: int) -> None:
        """Mark the first token and the first ``first_text_sent`` characters of its text as
        streamed by the prefill side; a count its text cannot have ends the request here."""
        if not 0 <= first_text_sent <= len(request.output_text):
            self.scheduler.abort(request.request_id)
            raise ValueError(
                f"request {request.request_id!r}: the prefill side streamed {first_text_sent} "
                f"characters of a first token whose text has {len(request.output_text)} here"
            )
        request.num_tokens_sent = request.num_output_tokens
        request.num_text_sent = first_text_sent

    def release(self, request_id: str) -> None:
        """Free the pages a prefill-only request kept (its KV was transferred, or the lease expired)."""
        self.scheduler.release(request_id)

    def abort_request(self, request_id: str, keep_prefilled: bool = False) -> bool:
        """Abort and free a request; False when it is unknown or already finished (with
        ``keep_prefilled``: or prefilled, its pages held for their lease)."""
        request = self.scheduler.abort(request_id, keep_prefilled)
        if request is not None:
            self._record_finished(request)
        return request is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self, host_tier: bool = False) -> bool:
        """Forget every cached prefix page (``host_tier``: the host tier's too), so that no later
        request reads KV computed before; False, changing nothing, while a request holds pages
        (vLLM's rule; kvcache.KVCacheManager.reset_prefix_cache)."""
        return self.kv.reset_prefix_cache(host_tier)

    # ---- the step ----
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return an output for every request that got a token or finished."""
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        self.builder.release(sched.released_ids)
        changed = list(sched.finished)
        if sched.requests:
            batch = self.builder.build(sched)
            sampling = [r for r, s in zip(sched.requests, sched.sample, strict=True) if s]
            prompt_rows = plan_prompt_logits(sched.requests, sched.num_new_tokens)
            try:
                tokens = self.runner.execute(batch, sampling, prompt_rows)
            except BaseException as e:
                self._stop_ranks_after(e)
                raise
            changed.extend(self.scheduler.update(sched, tokens))
        outputs = [RequestOutput.from_request(r) for r in changed]
        num_finished = 0
        for request in changed:
            if request.is_finished:
                num_finished += 1
                self._record_finished(request)
            elif request.status is RequestStatus.PREFILLED:
                self._record_finished(request)  # handed off: the engine's part of it is done
        self.num_iterations += 1
        if self.iteration_stats.enabled:
            self.iteration_stats.append(
                IterationStats(
                    iteration=self.num_iterations,
                    timestamp=time.time(),
                    batch_size=len(sched.requests),
                    num_prefill_tokens=sched.num_prefill_tokens,
                    num_decode_tokens=sched.num_decode_tokens,
                    num_running=self.scheduler.num_running,
                    num_waiting=self.scheduler.num_waiting,
                    num_preempted=len(sched.preempted),
                    num_finished=num_finished,
                    step_time_s=time.perf_counter() - start,
                    kv=self.kv.stats(),
                )
            )
        return outputs

    def _stop_ranks_after(self, failure: BaseException) -> None:
        """After a tensor-parallel step failed on its way (runner.tp_failure): its ranks end
        (engine/tp/local_ranks.stop_after_failed_step)."""
        if self.runner.tp_failure and self.local_ranks is not None:
            ranks, self.local_ranks = self.local_ranks, None
            stop_after_failed_step(ranks, failure, self.runner.tp_failure)

    def _record_finished(self, request: Request) -> None:
        if not self.request_stats.enabled or request.stats_recorded:
            return
        request.stats_recorded = True
        self.request_stats.append(
            RequestStats(
                request.request_id,
                request.finish_reason,
                dataclasses.replace(request.metrics),
                tuple(request.token_gaps),
                request.error,
            )
        )

    # ---- stats (safe to call from another thread) ----
    def drain_iteration_stats(self) -> list[IterationStats]:
        return self.iteration_stats.drain()

    def drain_request_stats(self) -> list[RequestStats]:
        return self.request_stats.drain()


def _take_first_logprobs(request: Request, token_id: int, entry: TokenLogprobs | None) -> None:
    """Hand a first token sampled elsewhere its logprobs, before the scheduler takes the request:
    one asking for them without them is refused here, not left half-added."""
    if request.logprobs is not None and (entry is None or entry.token_id != token_id):
        raise ValueError(
            f"request {request.request_id!r} asks for logprobs, but its first token {token_id} "
            "came without them"
        )
    request.next_logprobs = entry
