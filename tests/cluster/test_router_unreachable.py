"""The router and workers it cannot reach (cluster/router.py): one Ray reports dead, or
unavailable (alive maybe, and maybe still running the request), before or after its answer
started. A worker that may still run a request is told to stop it; a request goes to another
worker only before its client had any of it."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import ray
from ray.exceptions import ActorUnavailableError

from cluster.messages import RequestClosed
from cluster.router import Router
from cluster.worker_choice import WorkerSlot
from engine.sampling_params import SamplingParams
from tests.cluster.cluster_fixtures import local_ray as start_local_ray
from tests.cluster.router_doubles import (
    HandingPrefill,
    KeepsAborts,
    KeepsCancels,
    closing,
    collect,
    one_to_one,
    wait_aborted,
    wait_cancelled,
)
from worker_common.messages import GenerateRequest, PrefillResult, TokenDelta


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    with start_local_ray("duet-test-router-unreachable"):
        yield


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
    """Every decode worker is dead for good (Ray's ActorDiedError: no restart left): the request
    ends with an error at once, not by retrying the dead worker until server.request_timeout_s
    (60 s here); P's lease ends, and the collector is told that P's handed-off report is the
    last (no decode worker will ever report it). Later requests fail before any prefill."""
    worker = HandingPrefill.remote()
    ray.get(worker.cancelled_ids.remote(), timeout=60)  # started: it answers within the deadline
    dead = _Dead.remote()
    ray.kill(dead, no_restart=True)
    router = one_to_one(worker, dead, call_timeout_s=60)
    closed = closing(router)
    req = GenerateRequest("orphan-1", [1, 2, 3], SamplingParams(), time.time())
    deltas = asyncio.run(collect(router, req))
    assert deltas[0].token_ids == [5]
    assert deltas[-1].error.startswith("every decode worker is dead"), deltas[-1].error
    assert router.choice.decode[0].dead
    assert closed == [RequestClosed("orphan-1", last_attempt=0, reason="error")]
    wait_cancelled(worker, "orphan-1")
    later = GenerateRequest("orphan-2", [1, 2, 3], SamplingParams(), time.time())
    (only,) = asyncio.run(collect(router, later))  # (no first token: nothing was prefilled)
    assert only.error.startswith("every decode worker is dead") and len(closed) == 1


@ray.remote(num_cpus=0)
class _Unreachable(KeepsAborts):
    """A decode worker alive but out of the router's reach: its call fails as an unavailable
    actor's does, and it may still have the request."""

    async def decode(self, req: GenerateRequest, pre: PrefillResult) -> AsyncIterator[TokenDelta]:
        raise ActorUnavailableError("the connection to the actor was lost", None)
        yield  # (a streaming call, as the decode worker's)


@ray.remote(num_cpus=0)
class _Answering(KeepsAborts):
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
    wait_aborted(unreachable, "moved-1")
    assert ray.get(answering.aborts.remote(), timeout=30) == []


@ray.remote(num_cpus=0)
class _UnreachableOnce(KeepsAborts):
    """The only decode worker: its first call fails as unavailable (it may run on there); the
    next one serves, noting the aborts it had been sent by then."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[tuple[object, ...]]] = []

    async def decode(self, req: GenerateRequest, pre: PrefillResult) -> AsyncIterator[TokenDelta]:
        self.calls.append(list(self.aborted))
        if len(self.calls) == 1:
            raise ActorUnavailableError("the connection to the actor was lost", None)
        yield TokenDelta(req.request_id, [6], "y", "length", 3, 2)

    async def aborts_seen_by_each_call(self) -> list[list[tuple[object, ...]]]:
        return self.calls


def test_a_decode_worker_picked_again_has_its_old_call_aborted_first(local_ray: None) -> None:
    """No other decode worker is live, so the retry goes to the one found unavailable: its old
    call (which may run on) is aborted, and the abort answered, before the new call of the same
    request id goes there (an abort after it would stop the new call; no abort at all left two
    calls of one id on one worker, the second taking the first's pages)."""
    worker = _UnreachableOnce.remote()
    router = one_to_one(HandingPrefill.remote(), worker, call_timeout_s=60)
    req = GenerateRequest("again-1", [1, 2, 3], SamplingParams(), time.time())
    deltas = asyncio.run(collect(router, req))
    assert [d.token_ids for d in deltas] == [[5], [6]] and deltas[-1].error is None
    seen = ray.get(worker.aborts_seen_by_each_call.remote(), timeout=30)
    assert seen == [[], [("again-1",)]]


@ray.remote(num_cpus=0)
class _LostMidStream(KeepsAborts):
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
    assert [d.token_ids for d in deltas[:2]] == [[5], [6]]
    # The client is told the kind and where to look; Ray's text (the node's address, pids, actor
    # ids, a remote traceback) stays in the log.
    assert deltas[-1].error == (
        "decode worker d-0 failed (RayTaskError(ActorUnavailableError)); the server's log has why, "
        "under "
        "request lost-1"
    )
    wait_aborted(lost, "lost-1")


@ray.remote(num_cpus=0, max_restarts=0)
class _DiesMidStream:
    """A decode worker whose process exits after it streamed two tokens."""

    async def decode(self, req: GenerateRequest, pre: PrefillResult) -> AsyncIterator[TokenDelta]:
        yield TokenDelta(req.request_id, [6, 7], "yz", None, 3, 3)
        await asyncio.sleep(0.2)  # (the delta on its way before the process goes)
        os._exit(1)

    async def abort(self, *args: object) -> None:
        pass


def test_a_decode_worker_dead_mid_stream_closes_the_request_with_its_tokens(
    local_ray: None,
) -> None:
    """A decode worker that dies mid-stream reports nothing: the collector is told P's report is
    the last, and how many tokens the dead worker streamed, so the request's record counts the
    three tokens its client got, not P's one."""
    router = one_to_one(HandingPrefill.remote(), _DiesMidStream.remote(), call_timeout_s=60)
    closed = closing(router)
    req = GenerateRequest("died-1", [1, 2, 3], SamplingParams(), time.time())
    deltas = asyncio.run(collect(router, req))
    assert [d.token_ids for d in deltas[:2]] == [[5], [6, 7]]
    assert deltas[-1].error.startswith("decode worker d-0 failed (ActorDiedError)"), deltas[-1]
    assert closed == [RequestClosed("died-1", last_attempt=0, reason="error", decoded_tokens=2)]


@ray.remote(num_cpus=0)
class _UnreachablePrefill(KeepsCancels):
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
    unreachable, handing = _UnreachablePrefill.remote(), HandingPrefill.remote()
    workers = [WorkerSlot("p-0", unreachable), WorkerSlot("p-1", handing)]
    router = Router(workers, [WorkerSlot("d-0", None)], prefill_retries=1, call_timeout_s=60)
    req = GenerateRequest("unreachable-1", [1, 2, 3], SamplingParams(), time.time())
    pre, worker, attempts, _ = asyncio.run(router._prefill(req))
    assert pre is not None and worker is workers[1] and attempts == 2
    assert not workers[0].healthy and workers[1].healthy
    wait_cancelled(unreachable, "unreachable-1")
    assert ray.get(handing.cancelled_ids.remote(), timeout=30) == []


@ray.remote(num_cpus=0, max_restarts=1, max_task_retries=0)
class _CrashesOnce(KeepsAborts):
    """A decode worker whose process dies at its first request; Ray restarts it (a worker's
    max_restarts), and the new one serves."""

    async def decode(self, req: GenerateRequest, pre: PrefillResult) -> AsyncIterator[TokenDelta]:
        if not ray.get_runtime_context().was_current_actor_reconstructed:
            os._exit(1)
        yield TokenDelta(req.request_id, [6], "y", "length", 3, 2)


def test_a_decode_worker_ray_restarts_is_waited_for_not_given_up(local_ray: None) -> None:
    """Restarting is not dead: its call fails as unavailable, and the request waits for it (the
    retry goes to the restarted worker), which serves it whole."""
    crashing = _CrashesOnce.remote()
    router = one_to_one(HandingPrefill.remote(), crashing, call_timeout_s=60)
    req = GenerateRequest("restarted-1", [1, 2, 3], SamplingParams(), time.time())
    deltas = asyncio.run(collect(router, req))
    assert [d.token_ids for d in deltas] == [[5], [6]] and deltas[-1].error is None
    assert not router.choice.decode[0].dead
