"""The Prometheus metrics that the server exposes on /metrics, in a registry of their own.

Names follow vLLM's where one exists (``vllm:time_to_first_token_seconds`` becomes
``duet:time_to_first_token_seconds``), so existing dashboards need only a prefix change, and a name
means what it means in vLLM: ``request_time_per_output_token_seconds`` is each request's mean time
per output token, ``inter_token_latency_seconds`` each gap between two tokens. vLLM's old
``time_per_output_token_seconds`` (deprecated in 0.11, since removed) was the inter-token latency,
not the per-request mean; it is not exported: a dashboard that reads it should read
``inter_token_latency_seconds``. Every metric carries a ``model_name`` label; per-worker gauges add
``role`` and ``worker``. A worker's KV cache metrics (per pool group and tier) are
cluster/kv_cache_metrics.py's, in the same registry.

Counters that workers keep themselves (transfer failures and their outcomes, expired leases,
refused peers, injected faults) arrive as running totals
through ``set_worker_stats``; the difference to the previous total is added. A worker that
restarted (another process id) counts from zero again, as does a total that went down.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from cluster.kv_cache_metrics import PREFIX, KVCacheMetrics, running_delta
from cluster.messages import PerfRecord
from kvcache.stats import KVCacheStats
from worker_common.messages import Role

# Latency buckets (seconds): 1 ms to 10 min, dense where interactive serving lives.
LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
)  # fmt: skip


@dataclass
class _WorkerTotals:
    pid: int | None = None  # the process the totals below came from
    transfers_ok: int = 0
    transfer_failures: int = 0
    expired_leases: int = 0
    transfer_recomputed: int = 0
    transfer_failed_requests: int = 0
    refused_peers: int = 0
    injected_faults: int = 0
    wedged_messages: int = 0
    refused_pulls: int = 0
    rejected_messages: int = 0


class ServingMetrics:
    """Owns a dedicated CollectorRegistry; one instance per server process."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        reg, model = self.registry, ["model_name"]
        worker = ["model_name", "role", "worker"]

        def histogram(
            name: str, doc: str, buckets: tuple[float, ...], labels: list[str]
        ) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg)

        self.ttft = histogram(
            "time_to_first_token_seconds",
            "Time to first token, from the request's arrival at the server (failed prefill "
            "attempts included: duet:router_prefill_retries_total counts them).",
            LATENCY_BUCKETS,
            model,
        )
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Mean time per output token after the first, per request of two or more output "
            "tokens (vLLM also counts the others, as 0).",
            TOKEN_LATENCY_BUCKETS,
            model,
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Gap between consecutive output tokens (the gap from the prefill worker's first "
            "token to the decode worker's next has the KV transfer in it).",
            TOKEN_LATENCY_BUCKETS,
            model,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "End-to-end request latency, from the request's arrival at the server.",
            LATENCY_BUCKETS,
            model,
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "Time spent running the prompt.", LATENCY_BUCKETS, model
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Time waiting in a worker's scheduler queue.",
            LATENCY_BUCKETS,
            ["model_name", "role"],
        )
        self.transfer_latency = histogram(
            "kv_transfer_latency_seconds",
            "KV cache transfer from prefill to decode worker.",
            LATENCY_BUCKETS,
            model,
        )

        self.num_waiting = Gauge(
            PREFIX + "num_requests_waiting", "Requests in a worker's queue.", worker, registry=reg
        )
        self.num_running = Gauge(
            PREFIX + "num_requests_running", "Requests a worker is running.", worker, registry=reg
        )
        self.kv_usage = Gauge(
            PREFIX + "kv_cache_usage_perc",
            "Fraction of a worker's KV cache pages in use (1 = full): of its fullest pool group "
            "(full attention, each sliding window), as a request needs pages in every group.",
            worker,
            registry=reg,
        )
        self.kv_peak_usage = Gauge(
            PREFIX + "kv_cache_peak_usage_perc",
            "Most of kv_cache_usage_perc during a worker's last complete stats interval "
            "(stats.interval_s): the fullest pool group's peak share of its pages.",
            worker,
            registry=reg,
        )

        self.kv = KVCacheMetrics(reg, worker)

        self.request_success = Counter(
            PREFIX + "request_success_total",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens_total", "Prompt tokens processed.", model, registry=reg
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens_total", "Output tokens generated.", model, registry=reg
        )
        self.transfer_bytes = Counter(
            PREFIX + "kv_transfer_bytes_total",
            "KV cache bytes moved between workers.",
            model,
            registry=reg,
        )
        self.transfers_ok = Counter(
            PREFIX + "kv_transfers_ok_total",
            "KV transfers that moved a request's pages, as each side saw them (a pull counts on "
            "the prefill and on the decode worker; sum one role). With the failures: the "
            "failure rate.",
            worker,
            registry=reg,
        )
        self.transfer_failures = Counter(
            PREFIX + "kv_transfer_failures_total",
            "Failed KV transfers, as each side saw them: on the decode worker every failed pull, "
            "on the prefill worker those that reached it (not one that failed to connect, nor a "
            "lease that ended while the decode worker waited for pages): read the decode role.",
            worker,
            registry=reg,
        )
        # The router's own: why a request's latencies include failed attempts (/perf_metrics
        # names them per request).
        self.prefill_retries = Counter(
            PREFIX + "router_prefill_retries_total",
            "Prefills the router tried again on another prefill worker after one failed "
            "(router.prefill_retries).",
            model,
            registry=reg,
        )
        self.local_fallbacks = Counter(
            PREFIX + "router_local_prefill_fallbacks_total",
            "Requests a decode worker prefilled itself because no prefill worker could "
            "(router.local_prefill_fallback).",
            model,
            registry=reg,
        )
        self._router_seen = (0, 0)  # (prefill retries, local fallbacks) exported so far
        self.expired_leases = Counter(
            PREFIX + "kv_transfer_expired_leases_total",
            "KV leases that expired before the decode worker acknowledged.",
            worker,
            registry=reg,
        )
        # What a decode worker did after a failed pull (transfer.on_failure).
        self.transfer_recomputed = Counter(
            PREFIX + "kv_transfer_recomputed_total",
            "Requests whose KV transfer failed and that the decode worker prefilled itself.",
            worker,
            registry=reg,
        )
        self.transfer_failed_requests = Counter(
            PREFIX + "kv_transfer_failed_requests_total",
            "Requests that ended with an error because their KV transfer failed.",
            worker,
            registry=reg,
        )
        self.refused_peers = Counter(
            PREFIX + "kv_transfer_refused_peers_total",
            "Transfer peers refused in the handshake (no cluster secret, another model, ...).",
            worker,
            registry=reg,
        )
        self.injected_faults = Counter(
            PREFIX + "kv_transfer_injected_faults_total",
            "KV pulls failed on purpose (transfer.fault_injection).",
            worker,
            registry=reg,
        )
        self.wedged_messages = Counter(
            PREFIX + "kv_transfer_wedged_messages_total",
            "UCX messages that did not end when their link was aborted: each holds a staging "
            "buffer until it ends (one into a decode worker's pages takes the worker down).",
            worker,
            registry=reg,
        )
        # What a peer that should not be trusted tried (with the refused peers above).
        self.refused_pulls = Counter(
            PREFIX + "kv_transfer_refused_pulls_total",
            "KV pulls a prefill worker refused: a forged, stale or replayed ticket, or a plan "
            "that does not fit its lease.",
            worker,
            registry=reg,
        )
        self.rejected_messages = Counter(
            PREFIX + "kv_transfer_rejected_messages_total",
            "Transfer control messages that did not decode (answered with Reject, skipped).",
            worker,
            registry=reg,
        )
        self._worker_totals: dict[tuple[str, str], _WorkerTotals] = {}
        self._totals_lock = threading.Lock()  # stats pollers may run on several threads

    def observe_request(self, record: PerfRecord) -> None:
        """Account one finished request (a joined record from the perf-metrics collector)."""
        model = self.model_name
        for histogram, value in (
            (self.ttft, record.ttft_s),
            (self.tpot, record.tpot_s),
            (self.e2e, record.e2e_s),
            (self.prefill_time, record.prefill_time_s),
            # (a transfer that moved nothing, failed or cut short, is no transfer latency)
            (self.transfer_latency, record.transfer_latency_s if record.transfer_bytes else None),
        ):
            if value is not None:
                histogram.labels(model).observe(value)
        for gap in record.token_gaps_s:
            self.itl.labels(model).observe(gap)
        for role in Role:
            queue_time = record.queue_time_s(role)
            if queue_time is not None:
                self.queue_time.labels(model, role.value).observe(queue_time)
        self.request_success.labels(model, record.finish_reason or "unknown").inc()
        self.prompt_tokens.labels(model).inc(record.prompt_tokens)
        self.generation_tokens.labels(model).inc(record.output_tokens)
        self.transfer_bytes.labels(model).inc(record.transfer_bytes)

    def set_worker_stats(
        self,
        worker_id: str,
        role: Role | str,
        num_waiting: int,
        num_running: int,
        kv_usage: float,
        transfer_failures_total: int = 0,
        transfers_ok_total: int = 0,
        expired_leases_total: int = 0,
        peak_kv_usage: float | None = None,
        transfer_recomputed_total: int = 0,
        transfer_failed_requests_total: int = 0,
        refused_peers_total: int = 0,
        injected_faults_total: int = 0,
        wedged_messages_total: int = 0,
        refused_pulls_total: int = 0,
        rejected_messages_total: int = 0,
        kv: KVCacheStats | None = None,
        kv_interval: KVCacheStats | None = None,
        pid: int | None = None,
    ) -> None:
        """Update one worker's gauges; the ``*_total`` arguments are the worker's running totals
        (of process ``pid``: another one than last time restarted them from zero);
        ``peak_kv_usage`` is None until the worker's first stats interval ended.
        ``kv``: the worker's KV stats now (per pool group and tier; its counters are running
        totals); ``kv_interval``: those taken at the end of its last complete stats interval (its
        peaks), None before the first."""
        for name, value in (("kv_usage", kv_usage), ("peak_kv_usage", peak_kv_usage)):
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} is a fraction in [0, 1], got {value}")
        labels = (self.model_name, Role(role).value, worker_id)
        self.num_waiting.labels(*labels).set(num_waiting)
        self.num_running.labels(*labels).set(num_running)
        self.kv_usage.labels(*labels).set(kv_usage)
        if peak_kv_usage is not None:
            self.kv_peak_usage.labels(*labels).set(peak_kv_usage)
        totals = {  # _WorkerTotals field and counter attribute -> the worker's running total
            "transfers_ok": transfers_ok_total,
            "transfer_failures": transfer_failures_total,
            "expired_leases": expired_leases_total,
            "transfer_recomputed": transfer_recomputed_total,
            "transfer_failed_requests": transfer_failed_requests_total,
            "refused_peers": refused_peers_total,
            "injected_faults": injected_faults_total,
            "wedged_messages": wedged_messages_total,
            "refused_pulls": refused_pulls_total,
            "rejected_messages": rejected_messages_total,
        }
        with self._totals_lock:
            seen = self._worker_totals.setdefault((labels[1], worker_id), _WorkerTotals())
            restarted = pid is not None and seen.pid not in (None, pid)
            if restarted:
                seen = self._worker_totals[(labels[1], worker_id)] = _WorkerTotals()
            seen.pid = pid
            deltas = {k: running_delta(getattr(seen, k), v) for k, v in totals.items()}
            for k, v in totals.items():
                setattr(seen, k, v)
        for name, delta in deltas.items():
            getattr(self, name).labels(*labels).inc(delta)
        if restarted:
            self.kv.restarted(labels)
        if kv is not None:
            self.kv.set(labels, kv, kv_interval)

    def set_router_totals(self, prefill_retries: int, local_fallbacks: int) -> None:
        """The router's running totals (``Router.num_prefill_retries``, ``num_local_fallbacks``:
        this process's, so they only grow)."""
        with self._totals_lock:
            seen, self._router_seen = self._router_seen, (prefill_retries, local_fallbacks)
        self.prefill_retries.labels(self.model_name).inc(max(prefill_retries - seen[0], 0))
        self.local_fallbacks.labels(self.model_name).inc(max(local_fallbacks - seen[1], 0))

    def remove_worker(self, worker_id: str, role: Role | str) -> None:
        """Forget a worker that left the cluster, so its gauges stop being exported."""
        self.hide_worker(worker_id, role)
        with self._totals_lock:
            self._worker_totals.pop((Role(role).value, worker_id), None)
        self.kv.forget((self.model_name, Role(role).value, worker_id))

    def hide_worker(self, worker_id: str, role: Role | str) -> None:
        """Stop exporting a worker's gauges (it is down: their last values would pass for
        current ones) until its next ``set_worker_stats``; its counters' totals are kept."""
        labels = (self.model_name, Role(role).value, worker_id)
        for metric in (self.num_waiting, self.num_running, self.kv_usage, self.kv_peak_usage):
            with contextlib.suppress(KeyError):  # a gauge it never set
                metric.remove(*labels)
        # Counters stay: their totals are history, and Prometheus handles a series that stops.
        self.kv.hide(labels)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric in this registry."""
        return generate_latest(self.registry)
