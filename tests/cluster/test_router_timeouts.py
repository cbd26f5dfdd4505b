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
from ray.exceptions import ActorUnavailableError

from cluster.builder import ClusterHandles
from cluster.config import ClusterConfig, config_from_dict
from cluster.messages import RequestClosed
from cluster.router import Router
from cluster.worker_choice import WorkerSlot
from cluster.worker_specs import worker_spec
from decode_worker.actor import DecodeWorkerActor
from engine.sampling_params import SamplingParams
from tests.cluster.cluster_fixtures import local_ray as start_local_ray
from worker_common.messages import GenerateRequest, PrefillResult, Role, TokenDelta


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    with start_local_ray("duet-test-router"):
        yield


class _KeepsCancels:
    """A prefill worker's cancel, kept: which requests the router cancelled there."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    async def cancelled_ids(self) -> list[str]:
        return list(self.cancelled)


def wait_cancelled(worker: object, request_id: str) -> None:
    """Until the router's cancel of ``request_id`` (and only it) reached ``worker``."""
    deadline = time.monotonic() + 30
    while ray.get(worker.cancelled_ids.remote(), timeout=30) != [request_id]:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, f"{request_id} was not cancelled on its worker"
        time.sleep(0.05)


def closing(router: Router) -> list[RequestClosed]:
    """The requests ``router`` closes with the collector, as they are closed."""
    closed: list[RequestClosed] = []
    router.close_request = closed.append
    return closed


def one_to_one(prefill: object, decode: object = None, call_timeout_s: float = 60) -> Router:
    """A router over one prefill and one decode worker."""
    return Router(
        [WorkerSlot("p-0", prefill)], [WorkerSlot("d-0", decode)], call_timeout_s=call_timeout_s
    )


@ray.remote(num_cpus=0)
class StuckPrefill(_KeepsCancels):
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
class HandingPrefill(_KeepsCancels):
    """A prefill worker that prefills at once and hands the request off (a lease to pull)."""

    async def prefill(self, req: GenerateRequest) -> PrefillResult:
        return PrefillResult(req.request_id, 5, "x", None, ticket=None)


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


@ray.remote(num_cpus=0)
class _Dead:
    """A decode worker, killed before any call."""

    async def decode(self, req: GenerateRequest, pre: PrefillResult) -> AsyncIterator[TokenDelta]:
        raise AssertionError("a dead decode worker ran a request")
        yield  # (a streaming call, as the decode worker's)

    async def abort(self, *args: object) -> None:
        pass


def test_a_request_whose_decode_workers_died_is_closed_with_the_prefill_report(
    local_ray: None,
) -> None:
    """Every decode worker is dead: the request ends with an error at server.request_timeout_s,
    P's lease ends at once, and the collector is told that P's handed-off report is the last (no
    decode worker will ever report it; the record waited for one until its pending bound)."""
    worker = HandingPrefill.remote()
    ray.get(worker.cancelled_ids.remote(), timeout=60)  # started: it answers within the deadline
    dead = _Dead.remote()
    ray.kill(dead, no_restart=True)
    router = one_to_one(worker, dead, call_timeout_s=2)
    closed = closing(router)
    req = GenerateRequest("orphan-1", [1, 2, 3], SamplingParams(), time.time())
    deltas = asyncio.run(collect(router, req))
    assert deltas[0].token_ids == [5] and deltas[-1].error.startswith("decode worker d-0 failed")
    assert closed == [RequestClosed("orphan-1", last_attempt=0, reason="error")]
    wait_cancelled(worker, "orphan-1")


class _KeepsAborts:
    """A decode worker's abort, kept: the calls it was sent."""

    def __init__(self) -> None:
        self.aborted: list[tuple[object, ...]] = []

    async def abort(self, *args: object) -> None:
        self.aborted.append(args)

    async def aborts(self) -> list[tuple[object, ...]]:
        return list(self.aborted)


@ray.remote(num_cpus=0)
class _Unreachable(_KeepsAborts):
    """A decode worker alive but out of the router's reach: its call fails as an unavailable
    actor's does, and it may still have the request."""

    async def decode(self, req: GenerateRequest, pre: PrefillResult) -> AsyncIterator[TokenDelta]:
        raise ActorUnavailableError("the connection to the actor was lost", None)
        yield  # (a streaming call, as the decode worker's)


@ray.remote(num_cpus=0)
class _Answering(_KeepsAborts):
    async def decode(self, req: GenerateRequest, pre: PrefillResult) -> AsyncIterator[TokenDelta]:
        yield TokenDelta(req.request_id, [6], "y", "length", 3, 2)


def test_a_decode_worker_replaced_as_unavailable_is_told_to_abort(local_ray: None) -> None:
    """An unavailable decode worker may only be unreachable and still run the request: the
    router tells it to abort (no report: the one that serves it reports) before another takes
    the request, which the client gets whole."""
    unreachable, answering = _Unreachable.remote(), _Answering.remote()
    router = Router(
        [WorkerSlot("p-0", HandingPrefill.remote())],
        [WorkerSlot("d-0", unreachable), WorkerSlot("d-1", answering)],
        call_timeout_s=60,
    )
    req = GenerateRequest("moved-1", [1, 2, 3], SamplingParams(), time.time())
    deltas = asyncio.run(collect(router, req))
    assert [d.token_ids for d in deltas] == [[5], [6]] and deltas[-1].error is None
    deadline = time.monotonic() + 30
    while ray.get(unreachable.aborts.remote(), timeout=30) != [("moved-1",)]:
        assert time.monotonic() < deadline, "the replaced decode worker was not told to abort"
        time.sleep(0.05)
    assert ray.get(answering.aborts.remote(), timeout=30) == []


@ray.remote(num_cpus=0)
class _LostMidStream(_KeepsAborts):
    """A decode worker that streams a token and then goes out of the router's reach, maybe
    still decoding the request."""

    async def decode(self, req: GenerateRequest, pre: PrefillResult) -> AsyncIterator[TokenDelta]:
        yield TokenDelta(req.request_id, [6], "y", None, 3, 2)
        raise ActorUnavailableError("the connection to the actor was lost", None)


def test_a_decode_worker_lost_mid_stream_is_told_to_abort(local_ray: None) -> None:
    """Streaming started, so no other worker may take it over (the client has tokens): the
    request ends with an error, and the worker, which may still decode it for nobody with its
    pages held, is told to abort it."""
    lost = _LostMidStream.remote()
    router = Router(
        [WorkerSlot("p-0", HandingPrefill.remote())], [WorkerSlot("d-0", lost)], call_timeout_s=60
    )
    req = GenerateRequest("lost-1", [1, 2, 3], SamplingParams(), time.time())
    deltas = asyncio.run(collect(router, req))
    assert [d.token_ids for d in deltas[:2]] == [[5], [6]] and "d-0 failed" in (
        deltas[-1].error or ""
    )
    deadline = time.monotonic() + 30
    while ray.get(lost.aborts.remote(), timeout=30) != [("lost-1",)]:
        assert time.monotonic() < deadline, "the lost decode worker was not told to abort"
        time.sleep(0.05)


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


async def collect(router: Router, req: GenerateRequest) -> list[TokenDelta]:
    return [d async for d in router.generate(req)]


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


@ray.remote(num_cpus=0)
class UnreachablePrefill(_KeepsCancels):
    """A prefill worker alive but out of the router's reach: its call fails as an unavailable
    actor's does, and it may still prefill the request and lease its KV."""

    async def prefill(self, req: GenerateRequest) -> None:
        raise ActorUnavailableError("the connection to the actor was lost", None)


def test_a_prefill_worker_unavailable_is_told_to_cancel_and_another_prefills(
    local_ray: None,
) -> None:
    """Unavailable is not dead: the call may still run there and lease pages nobody would pull.
    The router cancels the request there (the pages come back then, not at the lease's expiry),
    marks the worker down until its stats answer, and another worker prefills it."""
    unreachable, handing = UnreachablePrefill.remote(), HandingPrefill.remote()
    workers = [WorkerSlot("p-0", unreachable), WorkerSlot("p-1", handing)]
    router = Router(workers, [WorkerSlot("d-0", None)], prefill_retries=1, call_timeout_s=60)
    req = GenerateRequest("unreachable-1", [1, 2, 3], SamplingParams(), time.time())
    pre, worker, attempts, _ = asyncio.run(router._prefill(req))
    assert pre is not None and worker is workers[1] and attempts == 2
    assert not workers[0].healthy and workers[1].healthy
    wait_cancelled(unreachable, "unreachable-1")
    assert ray.get(handing.cancelled_ids.remote(), timeout=30) == []


def test_a_request_out_of_time_blames_no_prefill_worker(local_ray: None) -> None:
    workers = [WorkerSlot(f"p-{i}", handle=FailingPrefill.remote()) for i in range(2)]
    router = Router(workers, [WorkerSlot("d-0", None)], prefill_retries=1, call_timeout_s=1.0)
    late = GenerateRequest("late-2", [1, 2, 3], SamplingParams(), time.time() - 5)
    assert asyncio.run(router._prefill(late)) == (None, None, 0, -1)
    assert all(w.healthy and w.failures == 0 for w in workers)
