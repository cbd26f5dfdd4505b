"""Stand-ins for the workers behind a Router on a real local Ray (actors whose calls answer,
hang, fail or are lost as the test needs), and what the router tests read from them."""

from __future__ import annotations

import time

import ray

from cluster.messages import RequestClosed
from cluster.router import Router
from cluster.worker_choice import WorkerSlot
from worker_common.messages import GenerateRequest, PrefillResult, TokenDelta


class KeepsCancels:
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


@ray.remote(num_cpus=0)
class HandingPrefill(KeepsCancels):
    """A prefill worker that prefills at once and hands the request off (a lease to pull)."""

    async def prefill(self, req: GenerateRequest) -> PrefillResult:
        return PrefillResult(req.request_id, 5, "x", None, ticket=None)


class KeepsAborts:
    """A decode worker's abort, kept: the calls it was sent."""

    def __init__(self) -> None:
        self.aborted: list[tuple[object, ...]] = []

    async def abort(self, *args: object) -> None:
        self.aborted.append(args)

    async def aborts(self) -> list[tuple[object, ...]]:
        return list(self.aborted)


def wait_aborted(worker: object, request_id: str) -> None:
    """Until the router's abort of ``request_id`` (with no other argument, and only it) reached
    ``worker``."""
    deadline = time.monotonic() + 30
    while ray.get(worker.aborts.remote(), timeout=30) != [(request_id,)]:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, f"{request_id} was not aborted on its worker"
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


async def collect(router: Router, req: GenerateRequest) -> list[TokenDelta]:
    return [d async for d in router.generate(req)]
