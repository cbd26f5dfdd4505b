"""The router against a prefill worker that does not answer in time, on a real local Ray: the call
times out, the worker is marked unhealthy, and the router cancels the request there (the worker
may still prefill it later and lease its KV, which nobody would pull)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import ray

from cluster.router import Router, WorkerSlot
from engine.sampling_params import SamplingParams
from tests.cluster.cluster_fixtures import local_ray as start_local_ray
from worker_common.messages import GenerateRequest


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    with start_local_ray("duet-test-router"):
        yield


@ray.remote(num_cpus=0)
class StuckPrefill:
    """A prefill worker whose prefill never answers within the router's timeout."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def prefill(self, req: GenerateRequest) -> None:
        await asyncio.sleep(30)

    async def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    async def cancelled_ids(self) -> list[str]:
        return list(self.cancelled)


def test_a_timed_out_prefill_is_cancelled_on_its_worker(local_ray: None) -> None:
    worker = StuckPrefill.remote()
    slot = WorkerSlot("p-0", handle=worker)
    router = Router([slot], [WorkerSlot("d-0", handle=None)], prefill_retries=0, call_timeout_s=0.5)
    req = GenerateRequest("late-1", [1, 2, 3], SamplingParams(), time.time())
    pre, where = asyncio.run(router._prefill(req))
    assert (pre, where) == (None, None)  # the local fallback takes it from here
    assert not slot.healthy and slot.failures == 1 and slot.outstanding == 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if ray.get(worker.cancelled_ids.remote(), timeout=30) == ["late-1"]:
            break
        time.sleep(0.05)
    assert ray.get(worker.cancelled_ids.remote(), timeout=30) == ["late-1"]
