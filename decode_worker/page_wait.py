"""A decode worker's wait for free KV pages to receive a prefilled request into (the pages of its
receive plan, decode_worker/receive_plan.py): bounded by decode.page_wait_deadline_s, and by P's
lease on the request's KV (a pull after the lease ended would be refused, expired)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Any

from decode_worker.call_slots import CallSlot
from decode_worker.receive_plan import ReceivePlan, plan_receive
from engine.engine_loop import EngineLoop

POLL_S = 0.02  # how often the wait asks the engine for the pages again


class NoPagesInTime(RuntimeError):
    """No free KV pages for a request within decode.page_wait_deadline_s (the client is told so,
    naming the field; the log has the worker and request too)."""

    def __init__(self, worker_id: str, rid: str, prompt_tokens: int, wait_s: float) -> None:
        self.for_client = f"no free KV pages within {wait_s:g}s (decode.page_wait_deadline_s)"
        super().__init__(
            f"decode worker {worker_id}: {self.for_client}, for {rid} ({prompt_tokens} prompt "
            "tokens)"
        )


class LeaseEndedWaiting(RuntimeError):
    """P's lease on a request's KV ended while D still waited for pages to pull it into: the pull
    would be refused (expired), so D stops waiting then (transfer.on_failure decides the rest)."""


async def wait_for_pages(
    loop: EngineLoop,
    worker_id: str,
    rid: str,
    prompt: list[int],
    slot: CallSlot,
    wait_s: float,
    lease_expires_at: float | None,
) -> ReceivePlan | None:
    """Allocate the request's pages for its receive, waiting for free pages within ``wait_s``
    (NoPagesInTime), and only while P's lease on the KV lasts (``lease_expires_at``, wall-clock;
    LeaseEndedWaiting); None once the request is aborted meanwhile (it then takes none)."""
    start = time.monotonic()
    deadline = start + wait_s
    lease_end = math.inf if lease_expires_at is None else start + lease_expires_at - time.time()
    aio = asyncio.get_running_loop()
    while True:
        if slot.aborted:
            return None
        fut = loop.call(lambda e: plan_receive(e.kv, rid, prompt, len(e.scheduler.waiting)))
        try:
            got = await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            # The client went away while the allocation was queued or running: pages it got
            # must not stay held under an id nobody will free (nor be met by a later call).
            slot.keep()

            def freed(f: Any) -> None:  # (on the engine thread)
                if not (f.cancelled() or f.exception()):
                    loop.call(lambda e: e.kv.free(rid))
                with contextlib.suppress(RuntimeError):  # (the worker's loop closed)
                    aio.call_soon_threadsafe(slot.release)

            fut.add_done_callback(freed)
            raise
        if got is not None:
            return got
        now = time.monotonic()
        if now > deadline:
            raise NoPagesInTime(worker_id, rid, len(prompt), wait_s)
        if now > lease_end:
            raise LeaseEndedWaiting(
                f"the prefill worker's lease on the KV (transfer.lease_s) ended while decode "
                f"worker {worker_id} waited for free KV pages to pull it into"
            )
        await asyncio.sleep(POLL_S)
