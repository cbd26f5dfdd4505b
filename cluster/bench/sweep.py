"""A rate sweep on each target: warm up, run every rate, join server timings, compute goodput.

Results go into a JSON-ready dict as they are produced, so that when a run fails midway (server gone,
every request failing, a cluster that does not start) the caller still has, and saves, everything
gathered up to that point.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from cluster.bench.cache_reset import reset_prefix_cache
from cluster.bench.client import ClientSettings, Endpoint, StreamingClient, probe_models
from cluster.bench.errors import BenchError
from cluster.bench.kv_tier_counters import fetch_kv_tier_totals, kv_tier_fields
from cluster.bench.metrics import DEFAULT_PERCENTILES, summarize_run
from cluster.bench.perf_metrics import collect_server_timings, fetch_perf_metrics
from cluster.bench.records import BenchRequest, Prompt
from cluster.bench.runner import ArrivalSettings, RunOutcome, run_requests
from cluster.bench.slo import SloSpec, goodput_rate
from cluster.bench.target import Target


@dataclass(frozen=True)
class SweepOptions:
    """Everything about a sweep except the workload and the targets."""

    request_rates: tuple[float, ...] = (math.inf,)
    arrivals: ArrivalSettings = ArrivalSettings()
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    slos: SloSpec | None = None
    model: str | None = None  # None: the first model the server lists at /v1/models
    endpoint: Endpoint = "completions"
    request_timeout_s: float = 300.0
    run_deadline_s: float | None = None  # per rate, then unfinished requests fail (None: derived)
    ignore_eos: bool = True
    temperature: float = 0.0
    num_warmups: int = 1
    server_metrics_wait_s: float = 5.0  # how long to wait for late /perf_metrics entries
    show_progress: bool = True
    api_key: str | None = None  # None: the target's own (a config's server.api_key), if any
    env_api_key: str | None = None  # OPENAI_API_KEY: when neither --api-key nor the target says
    ready_timeout_s: float = 0.0  # how long a server that does not answer yet is waited for
    headers: Mapping[str, str] = field(default_factory=dict)  # more headers, on every request
    extra_body: Mapping[str, object] = field(default_factory=dict)  # joins every request's body
    reset_prefix_cache: bool = False  # a cold prefix cache before every run (cache_reset.py)

    def headers_for(self, target_key: str | None) -> dict[str, str]:
        """The headers of every request to a target whose own API key is ``target_key``: a
        bearer token (--api-key, else the target's, else OPENAI_API_KEY's, as `vllm bench serve`
        reads it), then the --header ones (which win)."""
        key = next((k for k in (self.api_key, target_key, self.env_api_key) if k), None)
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        return auth | dict(self.headers)


async def _pick_model(
    url: str, wanted: str | None, headers: Mapping[str, str], ready_timeout_s: float
) -> str:
    # A server still starting (`vllm bench serve --ready-check-timeout-sec`): asked again each
    # second until it answers or the time is up; then (or at once, by default) not answering
    # is the benchmark's error.
    deadline = time.monotonic() + ready_timeout_s
    while True:
        try:
            listed = await probe_models(url, headers=headers)
            break
        except BenchError as exc:
            if exc.unreachable and time.monotonic() + 1.0 < deadline:
                await asyncio.sleep(1.0)
                continue
            raise
    if wanted is not None:
        return wanted
    if not listed:
        raise BenchError(f"the server at {url} lists no model at /v1/models; pass --model")
    return listed[0]


def _unshared(prompt: Prompt) -> Prompt:
    """A prompt about as long as ``prompt`` that starts otherwise (token ids reversed, words
    rotated), so that no measured request finds the warm-up's pages in a prefix cache."""
    if isinstance(prompt, list):
        return prompt[::-1]
    words = prompt.split(" ")
    return " ".join(words[1:] + words[:1])


async def _warm_up(client: StreamingClient, request: BenchRequest, count: int, url: str) -> None:
    for _ in range(count):
        record = await client.send(-1, request)
        if not record.success:
            raise BenchError(f"the warm-up request to {url} failed: {record.error}")


def _run_entry(
    rate: float, options: SweepOptions, summary: dict[str, Any], outcome: RunOutcome
) -> dict[str, Any]:
    return {
        "request_rate": rate,
        "burstiness": options.arrivals.burstiness,
        "max_concurrency": options.arrivals.max_concurrency,
        "ramp_up_seconds": options.arrivals.ramp_up_s,
        "run_deadline_s": outcome.deadline_s,
        "deadline_hit": outcome.deadline_hit,
        **summary,
    }


def update_goodput(entry: dict[str, Any], chained: bool = False) -> None:
    """Set ``goodput``/``goodput_is_lower_bound`` of a target entry from its runs' SLO attainment.

    Only where the server got the rate each run names: not under a concurrency cap (a request
    due while the cap is reached waits for a slot outside its latencies, so every rate may pass
    while the server receives far less than it says), not with a ramp-up (its sends are neither
    at the rate nor rescaled to it), and not when requests are ``chained`` (a conversation's
    later turn waits for the one before). Each run's ``request_goodput`` (requests within the
    SLOs per second, achieved) stays."""
    runs = entry["runs"]
    if chained or any(
        run.get("max_concurrency") is not None or run.get("ramp_up_seconds") for run in runs
    ):
        return
    points = [
        (run["request_rate"], run["slo_attainment"])
        for run in entry["runs"]
        if "slo_attainment" in run
    ]
    if points:
        result = goodput_rate(points)
        entry["goodput"] = result.rate
        entry["goodput_is_lower_bound"] = result.lower_bound


async def sweep_url(
    url: str,
    entry: dict[str, Any],
    requests: Sequence[BenchRequest],
    options: SweepOptions,
    per_rate: Sequence[Sequence[BenchRequest]] | None = None,
    stats_interval_s: float | None = None,
    target_key: str | None = None,
) -> None:
    """Run every rate of the sweep against the server at ``url``, appending to ``entry["runs"]``.
    ``per_rate[i]``, when given, is the workload of the i-th rate (else ``requests`` at every rate).
    ``stats_interval_s``: how often the server hears from its workers, when known (a cluster the
    driver started): a run's KV host-tier figures are read one such interval after its end.
    ``target_key``: the server's own API key, when known (a cluster the driver started).

    Raises BenchError when the server cannot be reached, warm-up fails, or every request of a run
    failed (the sweep stops there; that run's results are in ``entry`` already).
    """
    headers = options.headers_for(target_key)
    model = await _pick_model(url, options.model, headers, options.ready_timeout_s)
    entry["model_id"] = model
    settings = ClientSettings(
        base_url=url,
        model=model,
        endpoint=options.endpoint,
        request_timeout_s=options.request_timeout_s,
        ignore_eos=options.ignore_eos,
        temperature=options.temperature,
        headers=headers,
        extra_body=options.extra_body,
    )
    async with StreamingClient(settings) as client:
        if requests and options.num_warmups > 0:
            first = requests[0]
            warm = replace(
                first, prompt=_unshared(first.prompt), output_len=min(first.output_len, 4)
            )
            await _warm_up(client, warm, options.num_warmups, url)
            await fetch_perf_metrics(url, headers=headers)  # drain the warm-up's entries
        tier_after = None  # the KV host tiers' counters after the last run
        for i, rate in enumerate(options.request_rates):
            arrivals = replace(options.arrivals, request_rate=rate)
            label = f"{entry['label']} @ {rate:g} req/s"
            if options.reset_prefix_cache:
                await reset_prefix_cache(url, headers)
            # The previous run's last read waited for the workers' stats: it is this run's start.
            tier_before = tier_after if tier_after is not None else await fetch_kv_tier_totals(url)
            outcome = await run_requests(
                client,
                per_rate[i] if per_rate is not None else requests,
                arrivals,
                options.run_deadline_s,
                options.show_progress,
                label,
            )
            ended = time.monotonic()
            await collect_server_timings(
                url, outcome.records, options.server_metrics_wait_s, headers=headers
            )
            tier_after = await fetch_kv_tier_totals(url)
            if tier_after is not None and stats_interval_s is not None:
                # A host tier: read again once the workers' stats cover the run's end.
                await asyncio.sleep(max(0.0, ended + stats_interval_s + 1.0 - time.monotonic()))
                tier_after = await fetch_kv_tier_totals(url)
            duration = max(outcome.duration_s, 1e-9)  # a run of instant failures can measure 0
            summary = summarize_run(outcome.records, duration, options.percentiles, options.slos)
            summary.update(kv_tier_fields(tier_before, tier_after))
            entry["runs"].append(_run_entry(rate, options, summary, outcome))
            update_goodput(entry, chained=any(r.after is not None for r in requests))
            if outcome.records and summary["completed"] == 0:
                first = next(r.error for r in outcome.records if r.error)
                raise BenchError(
                    f"every request to {url} failed at {rate:g} req/s; the first error: {first}"
                )


def run_sweeps(
    targets: Sequence[Target],
    requests: Sequence[BenchRequest],
    options: SweepOptions,
    results: dict[str, Any],
    per_rate: Sequence[Sequence[BenchRequest]] | None = None,
) -> None:
    """Sweep every target in turn (each started and stopped around its sweep) into ``results``;
    ``per_rate`` as in ``sweep_url``."""
    for target in targets:
        entry: dict[str, Any] = {"label": target.label, "url": None, "runs": []}
        results["targets"].append(entry)
        with target as url:
            entry["url"] = url
            asyncio.run(
                sweep_url(
                    url,
                    entry,
                    requests,
                    options,
                    per_rate,
                    target.stats_interval_s,
                    target.api_key,
                )
            )
