"""PrefillWorker: runs prompts, finalizes context, leases the pages and answers with a ticket.

Life of a request here (DESIGN section 3):
  admit -> chunked prefill -> first token sampled -> context finalized (the scheduler commits the
  prompt's pages for reuse in the same step) -> pages published under a lease -> reply.
The pages are released exactly once: by the transfer layer's release callback (ack from D, lease
expiry, fatal transfer error), never by this class directly while a ticket is outstanding.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

from cluster.messages import RequestTimings, Role
from engine.engine_core import LLMEngine
from engine.engine_loop import EngineLoop
from engine.output_stream import OutputStream
from engine.sampling_params import SamplingParams
from engine.worker_messages import GenerateRequest, PrefillResult

log = logging.getLogger(__name__)


class KVPublisher(Protocol):
    """The prefill side of the transceiver (transfer.KVSender)."""

    def publish(
        self, request_id: str, page_ids: dict[str, list[int]], declared_prompt_len: int
    ) -> Any: ...
    def cancel(self, request_id: str) -> bool: ...
    def stats(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


class PrefillError(RuntimeError):
    """The prefill of a request failed on this worker (the router may retry it elsewhere)."""


class PrefillWorker:
    """Plain class behind the prefill Ray actor. ``make_publisher`` receives the release callback."""

    def __init__(
        self,
        worker_id: str,
        engine: LLMEngine,
        make_publisher: Callable[[Callable[[str], None]], KVPublisher],
        report: Callable[[RequestTimings], None] | None = None,
        step_deadline_s: float = 300.0,
    ) -> None:
        self.worker_id = worker_id
        self.loop = EngineLoop(engine, name=f"{worker_id}-engine")
        self.publisher = make_publisher(self._release)
        self._report = report
        self._deadline_s = step_deadline_s
        self._pending: set[str] = set()  # admitted, no reply yet
        # Prefilled, their lease being made -> whether their client went away meanwhile.
        self._publishing: dict[str, bool] = {}

    # ---- called by the transfer layer (its own thread) ----
    def _release(self, request_id: str) -> None:
        def release(engine: LLMEngine) -> None:
            try:
                engine.release(request_id)
            except ValueError:
                log.warning("late release of %s dropped: it holds no pages", request_id)

        self.loop.call(release)

    # ---- API ----
    async def prefill(self, req: GenerateRequest) -> PrefillResult:
        """Prefill ``req`` and return its first token and transfer ticket. Raises ValueError for a
        request the client must fix, PrefillError for our own failures."""
        params = SamplingParams(**req.sampling)
        stream = OutputStream(asyncio.get_running_loop())
        received = time.time()
        rid = req.request_id
        self.loop.subscribe(rid, stream.push)
        self._pending.add(rid)
        try:
            await asyncio.wrap_future(
                self.loop.call(
                    lambda e: e.add_request(
                        rid, req.prompt_token_ids, params, prefill_only=True, arrival_time=received
                    )
                )
            )
            out = await stream.get(self._deadline_s)
            self.loop.unsubscribe(rid)  # a prefill-only request yields exactly one output
        except ValueError:
            self.loop.unsubscribe(rid)
            raise
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            self.loop.unsubscribe(rid)
            self.loop.call(lambda eng: eng.abort_request(rid))
            if isinstance(e, asyncio.CancelledError):
                raise
            raise PrefillError(f"prefill of {rid} did not finish within {self._deadline_s}s") from e
        finally:
            self._pending.discard(rid)
        if out.error:
            raise PrefillError(out.error)
        if out.finish_reason == "abort":
            raise PrefillError(f"prefill of {rid} was aborted")
        first = out.token_ids[0]
        ticket = None
        if not out.finished:
            ticket = await self._publish(rid, len(req.prompt_token_ids))
        timings = self._timings(req, out, received, handed_off=ticket is not None)
        if self._report:
            self._report(timings)
        return PrefillResult(
            request_id=rid,
            first_token_id=first,
            first_token_text=out.text,
            finish_reason=out.finish_reason if out.finished else None,
            ticket=ticket,
            timings={
                "prefill_received": received,
                "first_token_time": out.metrics.first_token_time or time.time(),
            },
        )

    async def _publish(self, rid: str, prompt_len: int) -> Any:
        """Publish the pages of the PREFILLED request ``rid`` (committed, context finalized, and
        held) under a lease; a cancel that came meanwhile gives the lease up at once."""
        self._publishing[rid] = False
        try:
            pages = await asyncio.wrap_future(self.loop.call(lambda e: e.kv.page_ids(rid)))
            try:
                ticket = self.publisher.publish(rid, pages, prompt_len)
            except Exception as e:
                self._release(rid)
                raise PrefillError(f"could not publish the KV of {rid}: {e}") from e
        finally:
            cancelled = self._publishing.pop(rid)
        if cancelled:
            self.publisher.cancel(rid)
        return ticket

    async def cancel(self, request_id: str) -> None:
        """The client went away: stop the prefill, or give up the lease of a finished one."""
        if request_id in self._publishing:  # prefilled, not yet leased: ``_publish`` cancels
            self._publishing[request_id] = True
        elif request_id in self._pending:
            await asyncio.wrap_future(self.loop.call(lambda e: e.abort_request(request_id)))
        else:
            self.publisher.cancel(request_id)

    def _timings(
        self, req: GenerateRequest, out: Any, received: float, handed_off: bool
    ) -> RequestTimings:
        m = out.metrics
        return RequestTimings(
            request_id=req.request_id,
            role=Role.PREFILL,
            worker_id=self.worker_id,
            arrival_time=received,
            queue_start=m.arrival_time,
            queue_end=m.first_scheduled_time,
            prefill_start=m.first_scheduled_time,
            prefill_end=m.first_token_time,
            first_token_time=m.first_token_time,
            prompt_tokens=len(req.prompt_token_ids),
            cached_tokens=m.num_cached_tokens,
            output_tokens=len(out.token_ids),
            finish_time=None if handed_off else time.time(),
            finish_reason=None if handed_off else out.finish_reason,
            last_report=not handed_off,
        )

    def stats(self) -> dict[str, Any]:
        engine = self.loop.engine
        kv = engine.kv.stats()
        return {
            "worker_id": self.worker_id,
            "pid": os.getpid(),
            "role": "prefill",
            "healthy": self.loop.alive,
            "num_waiting": engine.scheduler.num_waiting,
            "num_running": engine.scheduler.num_running,
            "num_pending": len(self._pending),
            "kv": kv,
            "transfer": self.publisher.stats(),
        }

    def close(self) -> None:
        try:
            self.publisher.close()
        finally:
            self.loop.stop()
