"""``duet bench --reset-prefix-cache`` (cluster/bench/cache_reset.py): against the real Duet app
over a real decode worker, two runs of the same prompts, the second finds nothing the first left
(without the reset it reads them from the prefix cache); a server without the endpoint is the
benchmark's error."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import pytest

from cluster.bench.cache_reset import reset_prefix_cache
from cluster.bench.errors import BenchError
from cluster.bench.records import BenchRequest
from cluster.bench.sweep import SweepOptions, sweep_url
from cluster.serve import start_server_thread, stop_server_thread
from cluster.server import create_app
from tests.cluster.worker_backend import MODEL, WorkerBackend

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8] * 5, [9, 10, 11, 12, 13, 14, 15, 16] * 5]  # 40 tokens each


@pytest.fixture
def duet_url(backend: WorkerBackend) -> Iterator[str]:
    server, thread, port = start_server_thread(create_app(backend), "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_server_thread(server, thread)


def hits_over_two_runs(url: str, backend: WorkerBackend, reset: bool) -> int:
    """Prompt tokens the worker read from its prefix cache during two runs of the same prompts."""
    requests = [BenchRequest(p, len(p), 2) for p in PROMPTS]
    options = SweepOptions(
        request_rates=(math.inf, math.inf),
        model=MODEL,
        num_warmups=0,
        server_metrics_wait_s=0.0,
        show_progress=False,
        reset_prefix_cache=reset,
    )
    before = backend.worker.stats().kv.reuse_hit_tokens
    entry: dict = {"label": "duet", "runs": []}
    asyncio.run(sweep_url(url, entry, requests, options))
    assert [run["completed"] for run in entry["runs"]] == [2, 2]
    return backend.worker.stats().kv.reuse_hit_tokens - before


def test_every_run_starts_with_a_cold_prefix_cache(duet_url: str, backend) -> None:
    assert hits_over_two_runs(duet_url, backend, reset=False) > 0  # the second run reads them
    assert hits_over_two_runs(duet_url, backend, reset=True) == 0


def test_a_server_without_the_endpoint_is_the_benchmarks_error(duet_server) -> None:
    with pytest.raises(BenchError, match="does not offer POST /reset_prefix_cache"):
        asyncio.run(reset_prefix_cache(duet_server.url))
