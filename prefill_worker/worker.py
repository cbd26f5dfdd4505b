"""PrefillWorker: runs prompts, finalizes context, leases the pages and answers with a ticket.

Life of a request here (DESIGN section 3):
  admit -> chunked prefill -> first token sampled -> context finalized (the scheduler commits the
  prompt's pages for reuse in the same step) -> pages published under a lease -> reply.
The pages are released exactly once: by the transfer layer's release callback (ack from D, lease
expiry, fatal transfer error), never by this class directly while a ticket is outstanding.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from engine.engine_core import LLMEngine
from engine.engine_loop import EngineLoop
from engine.output_stream import OutputStream
from transfer.messages import TransferTicket
from transfer.stats import TransferStats
from worker_common.kv_events import KVEventPublisher
from worker_common.messages import (
    GenerateRequest,
    PrefillResult,
    Role,
    StatsBatch,
    WorkerDeadlines,
    WorkerStats,
)
from worker_common.recent_ids import RecentIds
from worker_common.request_report import Sink, WorkerFacts
from worker_common.worker_stats import WorkerStatsKeeper, transfer_totals

log = logging.getLogger(__name__)
T = TypeVar("T")


class KVPublisher(Protocol):
    """The prefill side of the transceiver (transfer.KVSender)."""

    # A tensor-parallel worker's publisher (worker_common/tp_transfer.py) answers with
    # awaitables: it awaits its other ranks on the worker's loop rather than block it.
    def publish(
        self, request_id: str, page_ids: dict[str, list[int]], declared_prompt_len: int
    ) -> TransferTicket | Awaitable[TransferTicket]: ...
    def cancel(self, request_id: str) -> bool | Awaitable[bool]: ...
    def stats(self) -> dict[str, Any]: ...
    def drain_transfer_stats(self) -> list[TransferStats]: ...
    def close(self) -> None: ...


async def _settled(answer: T | Awaitable[T]) -> T:
    return await answer if inspect.isawaitable(answer) else answer


class PrefillError(RuntimeError):
    """The prefill of a request failed on this worker (the router may retry it elsewhere)."""


class PrefillWorker:
    """Plain class behind the prefill Ray actor. ``make_publisher`` receives the release callback;
    ``report`` receives the per-request stats (None: none are recorded); with
    ``publish_kv_events`` the worker's KV events are kept for the router (``kv_events``)."""

    def __init__(
        self,
        worker_id: str,
        engine: LLMEngine,
        make_publisher: Callable[[Callable[[str], None]], KVPublisher],
        report: Sink | None = None,
        deadlines: WorkerDeadlines | None = None,
        stats_interval_s: float = 10.0,
        publish_kv_events: bool = False,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        """``on_fatal(reason)``: once the engine's loop has failed (EngineLoop; an actor goes
        down there)."""
        self.worker_id = worker_id
        self.keeper = WorkerStatsKeeper(worker_id, Role.PREFILL, stats_interval_s, report)
        self.kv_events = KVEventPublisher(worker_id, engine) if publish_kv_events else None
        self._deadline_s = (deadlines or WorkerDeadlines()).prefill_s
        # (a step longer than a prompt may take: every request in it is past its deadline)
        self.loop = EngineLoop(
            engine,
            name=f"{worker_id}-engine",
            on_tick=self._tick,
            stall_limit_s=self._deadline_s,
            on_fatal=on_fatal,
        )
        self.publisher = make_publisher(self._release)
        self._pending: set[str] = set()  # admitted, no reply yet
        # Prefilled, their lease being made -> whether their client went away meanwhile.
        self._publishing: dict[str, bool] = {}
        self._gone: set[str] = set()  # pending, their client gone (``cancel``)
        self._arrived = RecentIds()  # (the calls that started here)
        # Cancelled before their call started here (the cancel overtook it): a call that still
        # comes is aborted at its add, as one the cancel found pending would be.
        self._cancelled_early = RecentIds()

    def _tick(self, engine: LLMEngine) -> None:
        self.keeper.tick(engine)
        if self.kv_events is not None:
            self.kv_events.collect(engine)

    # ---- called by the transfer layer (on its loop: the actor's, or its own thread's) ----
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
        stream = OutputStream(asyncio.get_running_loop())
        received = time.time()
        rid = req.request_id
        prompt = req.prompt_token_ids.tolist()
        facts = WorkerFacts(received, None, req.prefill_attempt, req.arrival_time)

        def add(e: LLMEngine) -> None:
            self.keeper.note(rid, facts)  # its report names the router's attempt
            e.add_request(rid, prompt, req.sampling, prefill_only=True, arrival_time=received)

        self.loop.subscribe(rid, stream.push)
        self._pending.add(rid)
        self._arrived.add(rid)
        try:
            # Shielded: a cancel while the add waits behind an engine step must not drop the add,
            # or nothing would report the request; added, it is aborted below and reported so.
            added = self.loop.call(add)
            if rid in self._cancelled_early:  # (reported as aborted, by the engine)
                self._cancelled_early.discard(rid)
                self._gone.add(rid)
                self.loop.abort(rid, "the client went away", keep_prefilled=True)
            await asyncio.shield(asyncio.wrap_future(added))
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
            raise PrefillError(
                f"prefill of {rid} did not finish within {self._deadline_s}s "
                "(prefill.prefill_deadline_s)"
            ) from e
        finally:
            self._pending.discard(rid)
            gone = rid in self._gone
            self._gone.discard(rid)
            # After whatever call aborted it: its facts go once the engine's record of it is out.
            self.loop.call(lambda e: self.keeper.retire(rid))
        if out.error:
            raise PrefillError(out.error)
        if gone and not out.finished:  # prefilled as the cancel came: no lease for it
            self._release(rid)
            raise PrefillError(f"prefill of {rid} was cancelled: the client went away")
        if out.finish_reason == "abort":
            raise PrefillError(f"prefill of {rid} was aborted")
        first = out.token_ids[0]
        ticket = None
        if not out.finished:
            ticket = await self._publish(rid, len(prompt))
        return PrefillResult(
            request_id=rid,
            first_token_id=first,
            # What the client may see now: the end a stop string could still claim is held back
            # (the decode side streams it, or drops it with the stop string).
            first_token_text=out.delta_text,
            finish_reason=out.finish_reason if out.finished else None,
            ticket=ticket,
            stop_reason=out.stop_reason if out.finished else None,
            first_token_logprobs=out.logprobs[0] if out.logprobs else None,
            prompt_logprobs=out.prompt_token_logprobs,
            num_cached_tokens=out.num_cached_tokens,
        )

    async def _publish(self, rid: str, prompt_len: int) -> TransferTicket:
        """Publish the pages of the PREFILLED request ``rid`` (committed, context finalized, and
        held) under a lease; a cancel that came meanwhile gives the lease up at once."""
        self._publishing[rid] = False
        try:
            try:
                pages = await asyncio.wrap_future(self.loop.call(lambda e: e.kv.page_ids(rid)))
                ticket = await _settled(self.publisher.publish(rid, pages, prompt_len))
            except asyncio.CancelledError:  # (no lease yet: nothing else would free the pages)
                self._release(rid)
                raise
            except Exception as e:
                self._release(rid)
                raise PrefillError(f"could not publish the KV of {rid}: {e}") from e
        finally:
            cancelled = self._publishing.pop(rid)
        if cancelled:
            await _settled(self.publisher.cancel(rid))
        return ticket

    async def cancel(self, request_id: str) -> None:
        """The client went away: stop the prefill, or give up the lease of a finished one."""
        if request_id in self._publishing:  # prefilled, not yet leased: ``_publish`` cancels
            self._publishing[request_id] = True
        elif request_id in self._pending:  # (its ``prefill`` call ends now, not at its deadline)
            self._gone.add(request_id)  # (prefilled meanwhile, it gives its pages back instead)
            await asyncio.wrap_future(
                self.loop.abort(request_id, "the client went away", keep_prefilled=True)
            )
        else:
            if request_id not in self._arrived:  # (no lease to give up: it was never made)
                self._cancelled_early.add(request_id)
            await _settled(self.publisher.cancel(request_id))

    def stats(self) -> WorkerStats:
        return self.keeper.stats(
            self.loop, len(self._pending), transfer_totals(self.publisher.stats())
        )

    def drain_stats(self) -> StatsBatch:
        return self.keeper.drain(self.stats(), self.loop, self.publisher)

    def close(self) -> None:
        try:
            self.publisher.close()
        finally:
            self.loop.stop()
