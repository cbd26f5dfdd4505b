"""The router's deadlines and retries on a real local Ray: a request whose time runs out in its
prefill is cancelled there (it may still prefill it later and lease its KV, which nobody would
pull), blames no worker and goes nowhere else; router.prefill_retries,
router.local_prefill_fallback and server.request_timeout_s with a real decode worker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import ray

from cluster.builder import ClusterHandles
from cluster.config import ClusterConfig, config_from_dict
from cluster.messages import RequestClosed
from cluster.router import Router
from cluster.worker_choice import WorkerSlot
from cluster.worker_specs import worker_spec
from decode_worker.actor import DecodeWorkerActor
from engine.sampling_params import SamplingParams
from tests.cluster.cluster_fixtures import local_ray as start_local_ray
from tests.cluster.router_doubles import (
    HandingPrefill,
    KeepsCancels,
    closing,
    collect,
    one_to_one,
    wait_cancelled,
)
from worker_common.messages import GenerateRequest, PrefillResult, Role, TokenDelta


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    with start_local_ray("duet-test-router"):
        yield


@ray.remote(num_cpus=0)
class StuckPrefill(KeepsCancels):
    """A prefill worker whose prefill never answers within the router's timeout."""

    async def prefill(self, req: GenerateRequest) -> None:
        await asyncio.sleep(30)


@ray.remote(num_cpus=0)
class FailingPrefill:
    """A prefill worker whose prefill fails at once (as one whose engine died)."""

    def __init__(self) -> None:
        self.attempts: list[int] = []

    async def prefill(self, req: GenerateRequest) -> None:
        self.attempts.append(req.prefill_attempt)
        raise RuntimeError("this prefill worker is broken")

    async def attempts_seen(self) -> list[int]:
        return list(self.attempts)

    async def cancel(self, request_id: str) -> None:
        pass


@ray.remote(num_cpus=0)
class CountingDecode:
    """A decode worker that counts the requests it is given."""

    def __init__(self) -> None:
        self.calls = 0

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        self.calls += 1
        yield TokenDelta(req.request_id, [7], "x", "length", 3, 1)

    async def abort(self, *args: object) -> None:
        pass

    async def calls_made(self) -> int:
        return self.calls


def test_a_request_out_of_time_in_its_prefill_is_cancelled_there_and_goes_nowhere_else(
    local_ray: None,
) -> None:
    """The request's time ran out, not the worker: it stays healthy (it used to be marked down,
    and every request after fell back to the decode worker's local prefill), and the request is
    not handed to the decode worker to prefill with no time left."""
    worker = StuckPrefill.remote()
    slot = WorkerSlot("p-0", handle=worker)
    decode = CountingDecode.remote()
    router = Router([slot], [WorkerSlot("d-0", decode)], prefill_retries=1, call_timeout_s=0.5)
    closed = closing(router)
    req = GenerateRequest("late-1", [1, 2, 3], SamplingParams(), time.time())
    deltas = asyncio.run(collect(router, req))
    assert len(deltas) == 1 and "server.request_timeout_s (0.5s)" in (deltas[0].error or "")
    assert slot.healthy and slot.failures == 0 and slot.outstanding == 0
    assert router.num_local_fallbacks == 0 and router.num_prefill_retries == 0
    assert ray.get(decode.calls_made.remote(), timeout=30) == 0
    assert closed == [RequestClosed("late-1", last_attempt=0, reason="error")]
    wait_cancelled(worker, "late-1")  # (cancelled there, it reports)


def test_a_client_gone_during_its_prefill_is_closed_with_the_collector(local_ray: None) -> None:
    """Its prefill is cancelled and no decode worker will see it: the router closes it, so that
    the prefill worker's abort report completes its record (that report alone is not the last:
    a failed prefill may be retried)."""
    worker = StuckPrefill.remote()
    router = one_to_one(worker)
    closed = closing(router)

    async def leave_early() -> None:
        req = GenerateRequest("gone-1", [1, 2, 3], SamplingParams(), time.time())
        task = asyncio.ensure_future(collect(router, req))
        await asyncio.sleep(1.0)  # the prefill call is under way
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(leave_early())
    assert closed == [RequestClosed("gone-1", last_attempt=0)]
    wait_cancelled(worker, "gone-1")


@ray.remote(num_cpus=0)
class PullingDecode:
    """A decode worker whose pull takes long, and whose abort takes a while to be taken."""

    def __init__(self) -> None:
        self.aborted_at: float | None = None

    async def decode(self, req: GenerateRequest, pre: PrefillResult) -> AsyncIterator[TokenDelta]:
        await asyncio.sleep(30)
        yield TokenDelta(req.request_id, [], "", "length", 3, 1)

    async def abort(self, *args: object) -> None:
        await asyncio.sleep(0.3)
        self.aborted_at = self.aborted_at or time.time()  # (the first abort taken)

    async def when_aborted(self) -> float | None:
        return self.aborted_at


@ray.remote(num_cpus=0)
class TimedHandingPrefill:
    """HandingPrefill that notes when its cancel came."""

    def __init__(self) -> None:
        self.cancelled_at: float | None = None

    async def prefill(self, req: GenerateRequest) -> PrefillResult:
        return PrefillResult(req.request_id, 5, "x", None, ticket=None)

    async def cancel(self, request_id: str) -> None:
        self.cancelled_at = self.cancelled_at or time.time()  # (the first cancel)

    async def when_cancelled(self) -> float | None:
        return self.cancelled_at


def test_a_client_gone_mid_pull_ends_the_lease_only_once_the_decode_worker_took_the_abort(
    local_ray: None,
) -> None:
    """Sent together, P's cancel could end the lease before D heard of the abort: D's pull was
    refused and counted as a transfer failure, the request recorded as an error. Both the
    router's own cleanup and the server's abort of the request (sent as the client leaves)
    cancel P only once D took the abort."""
    prefill, decode = TimedHandingPrefill.remote(), PullingDecode.remote()
    router = one_to_one(prefill, decode)

    async def leave_mid_pull() -> None:
        req = GenerateRequest("mid-pull", [1, 2, 3], SamplingParams(), time.time())
        stream = router.generate(req)
        assert (await stream.__anext__()).token_ids == [5]  # P's first token
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.5)  # D's pull is under way
        task.cancel()
        await router.abort("mid-pull")  # (the server's, as the client leaves)
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 30
        while await prefill.when_cancelled.remote() is None:
            assert time.monotonic() < deadline, "P's lease was never cancelled"
            await asyncio.sleep(0.05)

    asyncio.run(leave_mid_pull())
    aborted, cancelled = ray.get([decode.when_aborted.remote(), prefill.when_cancelled.remote()])
    assert aborted is not None and cancelled >= aborted


def test_a_client_gone_at_its_first_token_frees_the_lease_and_is_closed(local_ray: None) -> None:
    """The client leaves once it has P's first token, before any decode worker took the
    request: P's lease ends at once (it pinned the pages until it expired) and the record of
    the request ends with P's report."""
    worker = HandingPrefill.remote()
    router = one_to_one(worker)
    closed = closing(router)

    async def leave_at_the_first_token() -> None:
        req = GenerateRequest("first-1", [1, 2, 3], SamplingParams(), time.time())
        stream = router.generate(req)
        assert (await stream.__anext__()).token_ids == [5]
        await stream.aclose()

    asyncio.run(leave_at_the_first_token())
    assert closed == [RequestClosed("first-1", last_attempt=0)]
    wait_cancelled(worker, "first-1")  # P's lease ends


# ---- a real decode worker (the embedded model, aggregated mode) behind the router ----


def config_of(**sections: dict) -> ClusterConfig:
    return config_from_dict(
        {"prefill": {"replicas": 0}, "model": {"max_model_len": 2048}, **sections}
    )


@pytest.fixture(scope="module")
def decode_worker(local_ray: None) -> Iterator[WorkerSlot]:
    spec = worker_spec(config_of(), Role.DECODE, 0, None)
    handle = DecodeWorkerActor.options(num_cpus=1, max_concurrency=100).remote(spec)
    ray.get(handle.ready.remote(), timeout=300)
    slot = WorkerSlot("decode-0", handle)
    # One request first: a fresh worker's first step (oneDNN primitives, first touches) can take
    # longer than the short request_timeout_s these tests set, which would time out before any token.
    warm = GenerateRequest("warm-up", [1, 2, 3], SamplingParams(max_tokens=2), time.time())
    assert asyncio.run(collect(router_of(config_of(), [], slot), warm))[-1].error is None
    yield slot
    ray.get(handle.close.remote(), timeout=60)
    ray.kill(handle)


def router_of(config: ClusterConfig, prefill: list[WorkerSlot], decode: WorkerSlot) -> Router:
    return ClusterHandles(config, None, prefill, [decode]).router()


def held_pages(slot: WorkerSlot) -> int:
    stats = ray.get(slot.handle.stats.remote(), timeout=30)
    return sum(g.used for g in stats.kv.groups.values())


def wait_no_pages_held(slot: WorkerSlot) -> None:
    deadline = time.monotonic() + 30
    while held_pages(slot):
        assert time.monotonic() < deadline, "pages still held"
        time.sleep(0.1)


def test_a_request_ends_at_server_request_timeout_s(decode_worker: WorkerSlot) -> None:
    router = router_of(config_of(server={"request_timeout_s": 2.0}), [], decode_worker)
    long = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
    deltas = asyncio.run(collect(router, GenerateRequest("slow", [1, 2, 3], long, time.time())))
    assert deltas[-1].error == "the request took longer than server.request_timeout_s (2s)"
    assert deltas[-1].timed_out  # (the server answers 504)
    assert 0 < sum(len(d.token_ids) for d in deltas) < 1500
    wait_no_pages_held(decode_worker)  # aborted on the decode worker too


@pytest.mark.parametrize("fallback", [True, False])
def test_router_local_prefill_fallback(decode_worker: WorkerSlot, fallback: bool) -> None:
    """A prefill that fails: with router.local_prefill_fallback the decode worker prefills the
    request itself; without it the request fails."""
    broken = WorkerSlot("p-0", handle=FailingPrefill.remote())
    config = config_of(router={"local_prefill_fallback": fallback, "prefill_retries": 0})
    router = router_of(config, [broken], decode_worker)
    closed = closing(router)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    req = GenerateRequest(f"fb-{fallback}", [1, 2, 3], params, time.time())
    deltas = asyncio.run(collect(router, req))
    assert broken.failures == 1
    if fallback:
        assert [d.error for d in deltas] == [None] * len(deltas)
        assert sum(len(d.token_ids) for d in deltas) == 3 and router.num_local_fallbacks == 1
        assert closed == []  # the decode worker's report is the last one
    else:
        assert (
            deltas[-1].error == "no prefill worker could serve the request (local fallback is off)"
        )
        # No decode worker will report it: the failed attempt's report completes its record.
        assert closed == [RequestClosed(req.request_id, last_attempt=0, reason="error")]
    wait_no_pages_held(decode_worker)


@pytest.mark.parametrize("retries", [0, 2])
def test_router_prefill_retries(local_ray: None, retries: int) -> None:
    """router.prefill_retries: how many other prefill workers a failed prefill is tried on."""
    broken = [WorkerSlot(f"p-{i}", handle=FailingPrefill.remote()) for i in range(4)]
    config = config_of(router={"prefill_retries": retries})
    router = ClusterHandles(config, None, broken, [WorkerSlot("d-0", None)]).router()
    req = GenerateRequest(f"retry-{retries}", [1, 2, 3], SamplingParams(), time.time())
    assert asyncio.run(router._prefill(req)) == (None, None, retries + 1, retries)
    assert sum(w.failures for w in broken) == retries + 1
    # Each attempt is numbered, so that the collector joins D's report with the right one.
    seen = ray.get([w.handle.attempts_seen.remote() for w in broken], timeout=30)
    assert sorted(a for worker in seen for a in worker) == list(range(retries + 1))
    assert router.num_prefill_retries == retries
    # Retries allowed but no other worker to make them on: none is counted.
    lone = ClusterHandles(config, None, broken[:1], [WorkerSlot("d-0", None)]).router()
    req = GenerateRequest(f"lone-{retries}", [1, 2, 3], SamplingParams(), time.time())
    assert asyncio.run(lone._prefill(req)) == (None, None, 1, 0)
    assert (broken[0].failures, lone.num_prefill_retries) == (2, 0)


def test_a_request_out_of_time_blames_no_prefill_worker(local_ray: None) -> None:
    workers = [WorkerSlot(f"p-{i}", handle=FailingPrefill.remote()) for i in range(2)]
    router = Router(workers, [WorkerSlot("d-0", None)], prefill_retries=1, call_timeout_s=1.0)
    late = GenerateRequest("late-2", [1, 2, 3], SamplingParams(), time.time() - 5)
    assert asyncio.run(router._prefill(late)) == (None, None, 0, -1)
    assert all(w.healthy and w.failures == 0 for w in workers)
