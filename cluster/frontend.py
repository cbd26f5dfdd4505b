"""The serving backend of the HTTP server: tokenizer, router, metrics and stats together.

Observability never waits on a worker: the stats poller (cluster/stats_poller.py) collects each
worker's stats in the background, and a second background task drains the perf-metrics collector
into the /perf_metrics buffer and the Prometheus histograms, every ``stats.interval_s``.
/perf_metrics also drains the collector when read (it waits on that actor, never on a worker), so
a reader sees the requests finished by then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from cluster.kv_event_feed import ActorSource, KVEventFeed
from cluster.openai_logprobs import token_id_name
from cluster.prom_metrics import ServingMetrics
from cluster.router import Router
from cluster.stats_poller import StatsPoller
from cluster.worker_choice import WorkerSlot
from engine.loaders.generation_defaults import GenerationDefaults
from engine.stats import StatsBuffer
from engine.tokenizer import Tokenizer
from worker_common.messages import GenerateRequest, ModelInfo, TokenDelta

log = logging.getLogger(__name__)

COLLECTOR_DRAIN_TIMEOUT_S = 10.0  # the collector is an aid: a scrape never hangs on it
RESET_ANSWER_S = 30.0  # a worker's answer to /reset_prefix_cache (one engine call)


class ClusterFrontend:
    """Implements ``cluster.server.ServingBackend`` on top of the router and the collector actor."""

    def __init__(
        self,
        router: Router,
        tokenizer: Tokenizer | None,
        model_name: str,
        model: ModelInfo,
        collector: Any,  # the perf-metrics collector actor handle
        *,
        stats_interval_s: float = 10.0,
        max_stats_len: int = 1000,
        perf_buffer_len: int = 10000,
        sampling_defaults: GenerationDefaults | None = None,
    ) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = model.max_model_len
        self.vocab_size = model.vocab_size
        self.sampling_defaults = sampling_defaults or GenerationDefaults()
        self.collector = collector
        self.metrics = ServingMetrics(model_name)
        self.poller = StatsPoller(
            router.prefill + router.decode, stats_interval_s, max_stats_len, self._export_worker
        )
        self.kv_feed: KVEventFeed | None = None
        if router.choice.kv_index is not None:
            sources = {w.worker_id: ActorSource(w.handle) for w in router.prefill + router.decode}
            self.kv_feed = KVEventFeed(sources, router.choice.kv_index)
        self.stats_interval_s = stats_interval_s
        # /perf_metrics is drained on read; what nobody read yet is kept by the buffer rule.
        self._perf: StatsBuffer[dict[str, Any]] = StatsBuffer(perf_buffer_len)
        self._perf_lock = threading.Lock()
        self._drain_lock = asyncio.Lock()  # one collector drain at a time (records join in order)
        # A drain the collector has not answered yet: its records are out of the collector, so
        # the next read waits for this answer rather than asking again (a new drain lost them).
        self._drain_ref: Any = None
        self._perf_task: asyncio.Task[None] | None = None

    # ---- life cycle (the HTTP server's lifespan) ----
    async def start(self) -> None:
        self.poller.start()
        if self.kv_feed is not None:
            self.kv_feed.start()
        if self._perf_task is None:
            self._perf_task = asyncio.get_running_loop().create_task(self._drain_collector_loop())

    async def stop(self) -> None:
        await self.poller.stop()
        if self.kv_feed is not None:
            await self.kv_feed.stop()
        if self._perf_task is not None:
            self._perf_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._perf_task
            self._perf_task = None

    # ---- request path ----
    @property
    def request_timeout_s(self) -> float:
        return self.router.call_timeout_s

    @property
    def has_tokenizer(self) -> bool:
        return self.tokenizer is not None

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(
                f"model {self.model_name!r} has no tokenizer (random weights): send token ids"
            )
        return self.tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._require_tokenizer().encode(text, add_special_tokens=add_special_tokens)

    def token_pieces(self, token_ids: list[int]) -> list[str]:
        """Each token's piece in the vocabulary (vLLM's token_strs: "Ġworld", not " world")."""
        tokenizer = self._require_tokenizer()
        return [tokenizer.id_to_token(t) or "" for t in token_ids]

    def token_text(self, token_id: int) -> str:
        """One token as the logprobs of an answer name it: its text, or ``token_id:<id>`` for a
        model without a tokenizer (vLLM's return_tokens_as_token_ids form)."""
        if self.tokenizer is None:
            return token_id_name(token_id)
        return self.tokenizer.token_text(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes, as chat logprobs give them (engine.tokenizer.Tokenizer's)."""
        if self.tokenizer is None:
            return token_id_name(token_id).encode()
        return self.tokenizer.token_bytes(token_id)

    def decode(self, token_ids: list[int]) -> str:
        """A prompt of token ids as text (``echo``); "" for a model without a tokenizer, whose
        answers have no text either."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        return self._require_tokenizer().encode_chat(
            messages,
            add_generation_prompt,
            continue_final_message=continue_final_message,
            variables=template_kwargs,
        )

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        return self.router.generate(request)

    async def abort(self, request_id: str) -> None:
        await self.router.abort(request_id)

    async def reset_prefix_cache(self, host_tier: bool) -> dict[str, bool | str]:
        """Every worker forgets its cached prefixes, all asked at once: worker id -> True (done),
        False (a request held pages there, so nothing changed), or why it did not answer."""
        workers = self.router.prefill + self.router.decode

        async def ask(w: WorkerSlot) -> bool | str:
            try:
                async with asyncio.timeout(RESET_ANSWER_S):
                    return bool(await w.handle.reset_prefix_cache.remote(host_tier))
            except TimeoutError:  # (it may still reset later: its engine was busy or stuck)
                return f"no answer within {RESET_ANSWER_S:g}s"
            except Exception as e:  # (a dead or restarting worker)
                return f"{type(e).__name__}: {e}"

        answers = await asyncio.gather(*(ask(w) for w in workers))
        return {w.worker_id: a for w, a in zip(workers, answers, strict=True)}

    # ---- observability ----
    async def health(self) -> dict[str, Any]:
        return self.router.health()

    async def _drain_collector(self) -> None:
        if self.collector is None:
            return
        async with self._drain_lock:
            if self._drain_ref is None:
                self._drain_ref = self.collector.drain.remote()
            try:
                # (asyncio.timeout, not wait_for: Python 3.11's wait_for loses a cancel that
                # lands as the answer comes, gh-86296, and this loop then ran on past the
                # server's stop, which waited for it for ever.)
                async with asyncio.timeout(COLLECTOR_DRAIN_TIMEOUT_S):
                    records = await self._drain_ref
            except TimeoutError:  # its answer comes with a later read
                log.warning(
                    "perf-metrics collector did not answer within %gs", COLLECTOR_DRAIN_TIMEOUT_S
                )
                return
            except Exception as e:  # the collector is an aid, never a reason to fail a scrape
                self._drain_ref = None
                log.warning("perf-metrics collector failed: %s", e)
                return
            self._drain_ref = None
            with self._perf_lock:
                for record in records:
                    self.metrics.observe_request(record)
                    self._perf.append(record.to_dict())

    async def _drain_collector_loop(self) -> None:
        while True:
            await asyncio.sleep(self.stats_interval_s)
            await self._drain_collector()

    async def metrics_text(self) -> bytes:
        for w in self.router.prefill + self.router.decode:
            self._export_worker(w)
        self.metrics.set_router_totals(
            self.router.num_prefill_retries, self.router.num_local_fallbacks
        )
        with self._perf_lock:
            return self.metrics.render()

    def _export_worker(self, w: WorkerSlot) -> None:
        s = w.last_stats
        if s is None:
            return
        # Its counters always take its last stats (the failures just before a worker went down
        # are the ones an operator looks for: skipped while it was down, they were lost when its
        # restarted process reset the totals); its gauges are hidden while it is down.
        self.metrics.set_worker_stats(
            w.worker_id,
            s.role,
            s.num_waiting,
            s.num_running,
            s.kv.usage,
            # (the fullest group's own peak share, as the usage gauge is the fullest group's)
            peak_kv_usage=s.kv_interval.peak_usage if s.kv_interval is not None else None,
            transfers_ok_total=s.transfer.transfers_ok,
            transfer_failures_total=s.transfer.failures,
            expired_leases_total=s.transfer.expired_leases,
            transfer_recomputed_total=s.transfer.recomputed,
            transfer_failed_requests_total=s.transfer.failed_requests,
            refused_peers_total=s.transfer.refused_peers,
            injected_faults_total=s.transfer.injected_faults,
            wedged_messages_total=s.transfer.wedged_messages,
            refused_pulls_total=s.transfer.refused_pulls,
            rejected_messages_total=s.transfer.rejected_messages,
            kv=s.kv,
            kv_interval=s.kv_interval,
            pid=s.pid,
        )
        if not w.healthy:  # down, or restarting: its last gauges are no current values
            self.metrics.hide_worker(w.worker_id, s.role)

    async def perf_metrics(self) -> list[dict[str, Any]]:
        await self._drain_collector()
        with self._perf_lock:
            return self._perf.drain()

    async def iteration_stats(self) -> list[dict[str, Any]]:
        return self.poller.drain_iterations()

    async def transfer_stats(self) -> list[dict[str, Any]]:
        return self.poller.drain_transfers()
