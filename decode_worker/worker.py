"""DecodeWorker: receives a request's KV from a prefill worker and joins it to the continuous batch.

Life of a request here (DESIGN section 3):
  gen-init (allocate pages for the prompt plus the next token as if the prompt were computed, so a
  sliding-window group holds only its last window; minus D's own prefix hit)
  -> pull the remaining pages from P, group by group -> check (every chunk arrived, declared
  history == prompt length) -> finalize context (commit the prompt's pages) and only then
  schedule decode -> stream tokens.
Pages allocated for a receive are freed only after the receive is known finished or failed, even
when the client went away meanwhile. A failed, expired or refused pull fails the request, or with
``on_failure="recompute"`` (transfer.on_failure) the request is prefilled here instead and the
client gets a normal completion. The same class also serves whole requests locally (the
aggregated mode, and the fallback when no prefill worker is healthy).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from decode_worker.call_slots import CallSlot, CallSlots
from decode_worker.engine_stream import stream_request
from decode_worker.page_wait import LeaseEndedWaiting, NoPagesInTime, wait_for_pages
from decode_worker.receive_plan import ReceivePlan
from engine.engine_core import LLMEngine
from engine.engine_loop import EngineLoop
from transfer.messages import TransferTicket
from transfer.stats import TransferResult, TransferStats
from worker_common.kv_events import KVEventPublisher
from worker_common.messages import (
    GenerateRequest,
    PrefillResult,
    Role,
    StatsBatch,
    TokenDelta,
    WorkerDeadlines,
    WorkerStats,
)
from worker_common.recent_ids import RecentIds
from worker_common.request_report import Sink, TransferFacts, WorkerFacts
from worker_common.worker_stats import WorkerStatsKeeper, transfer_totals

log = logging.getLogger(__name__)


class KVPuller(Protocol):
    """The decode side of the transceiver (transfer.KVReceiver)."""

    async def pull(
        self,
        ticket: TransferTicket,
        dst_page_ids: dict[str, list[int]],
        skip_pages: int | dict[str, int],
        expected_prompt_len: int,
    ) -> TransferResult: ...
    def stats(self) -> dict[str, Any]: ...
    def drain_transfer_stats(self) -> list[TransferStats]: ...
    def close(self) -> None: ...


class DecodeWorker:
    """Plain class behind the decode Ray actor. ``report`` receives the per-request stats (None:
    none are recorded); with ``publish_kv_events`` the worker's KV events are kept for the router
    (``kv_events``); ``on_fatal(reason)`` runs once the engine's loop has failed (EngineLoop)."""

    def __init__(
        self,
        worker_id: str,
        engine: LLMEngine,
        puller: KVPuller | None,
        report: Sink | None = None,
        deadlines: WorkerDeadlines | None = None,
        stats_interval_s: float = 10.0,
        publish_kv_events: bool = False,
        on_failure: str = "fail",
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        if on_failure not in ("fail", "recompute"):
            raise ValueError(f"on_failure must be 'fail' or 'recompute', got {on_failure!r}")
        self.worker_id = worker_id
        self.keeper = WorkerStatsKeeper(worker_id, Role.DECODE, stats_interval_s, report)
        self.kv_events = KVEventPublisher(worker_id, engine) if publish_kv_events else None
        deadlines = deadlines or WorkerDeadlines()  # (a step past token_s: a stuck worker)
        self.loop = EngineLoop(
            engine,
            name=f"{worker_id}-engine",
            on_tick=self._tick,
            stall_limit_s=deadlines.token_s,
            on_fatal=on_fatal,
        )
        self.puller = puller
        self._gen_init_deadline_s = deadlines.page_wait_s
        self._token_deadline_s = deadlines.token_s
        self._receiving: dict[str, asyncio.Task] = {}  # request id -> its pull, while in flight
        self._calls = CallSlots(deadlines.page_wait_s)  # (an earlier call's pages: pages too)
        # Requests whose caller gave up on them before their call ran here (``abort`` with
        # ``prompt_tokens``), newest last, bounded: a late call for one of them ends at once.
        self._gone = RecentIds()
        self._arrived = RecentIds()  # (the calls that started here)
        self.on_failure = on_failure
        self.num_transfer_failures = 0  # failed pulls (and pulls that could not run)
        self.num_transfer_recomputed = 0  # ... whose request was prefilled here instead
        self.num_transfer_failed_requests = 0  # ... whose request ended with an error

    def _tick(self, engine: LLMEngine) -> None:
        self.keeper.tick(engine)
        if self.kv_events is not None:
            self.kv_events.collect(engine)

    # ---- disaggregated path ----
    async def decode(self, req: GenerateRequest, pre: PrefillResult) -> AsyncIterator[TokenDelta]:
        """Receive the KV of a prefilled request and stream its tokens after the first one."""
        if self.puller is None:
            raise RuntimeError(
                f"decode worker {self.worker_id} has no transceiver (aggregated mode)"
            )
        if not self._arrive(req.request_id):
            return
        # The inner stream closed where this one is, inner first (aclosing): left to the loop's
        # finalizer, it would free the request after the slot went to a later call of the id.
        async with (
            self._calls.hold(req.request_id) as slot,
            contextlib.aclosing(self._decode(req, pre, slot)) as deltas,
        ):
            async for delta in deltas:
                yield delta

    async def _decode(
        self, req: GenerateRequest, pre: PrefillResult, slot: CallSlot
    ) -> AsyncIterator[TokenDelta]:
        assert self.puller is not None
        rid, prompt = req.request_id, req.prompt_token_ids.tolist()
        # (what it reports if it ends before a pull; a pull's facts are added to it)
        no_pull = WorkerFacts(time.time(), None, req.prefill_attempt, req.arrival_time)
        lease_ended: str | None = None  # why no pull is made: P's lease ended meanwhile
        try:
            lease = pre.ticket.lease_expires_at if pre.ticket is not None else None
            init = await wait_for_pages(
                self.loop, self.worker_id, rid, prompt, slot, self._gen_init_deadline_s, lease
            )
        except NoPagesInTime as e:
            self._ended_early(rid, len(prompt), no_pull, "error")
            log.warning("%s", e)
            yield TokenDelta(rid, [], "", "abort", len(prompt), 1, error=e.for_client)
            return
        except LeaseEndedWaiting as e:
            init, lease_ended = None, str(e)
        except (asyncio.CancelledError, Exception) as e:  # the client left, or the engine failed
            finish = "abort" if isinstance(e, asyncio.CancelledError) else "error"
            self._ended_early(rid, len(prompt), no_pull, finish)
            raise
        if slot.aborted or (init is None and lease_ended is None):  # aborted: no pull
            try:
                if init is not None:  # (it got them as the abort came)
                    await asyncio.shield(asyncio.wrap_future(self._free_pages(rid)))
            finally:
                self._ended_early(rid, len(prompt), no_pull, "abort")
            return
        transfer_start = time.time()
        if init is None:
            result, error = None, lease_ended
        else:
            result, error = await self._pull(req, pre, init, slot, no_pull, transfer_start)
        transfer_end = time.time()
        ok = result is not None and result.ok
        facts = dataclasses.replace(
            no_pull,
            transfer=TransferFacts(
                transfer_start,
                transfer_end,
                int(result.bytes) if ok else 0,
                result.stats.path if result is not None else None,
            ),
        )
        if not ok and not slot.aborted:  # (a pull its client's abort cut short did not fail)
            self.num_transfer_failures += 1
        if slot.aborted or not ok:
            try:
                # Shielded: a cancel (the client left) while the free waits behind an engine step
                # must not cancel the queued free itself, or the pages stay held for good.
                await asyncio.shield(asyncio.wrap_future(self._free_pages(rid)))
            except asyncio.CancelledError:
                self._ended_early(rid, len(prompt), facts, "abort")
                raise
        if slot.aborted:  # (also an abort that came while the failed pull's pages were freed)
            self._ended_early(rid, len(prompt), facts, "abort")
            return
        if not ok:
            why = result.error if result is not None else error
            if self.on_failure != "recompute":
                self.num_transfer_failed_requests += 1
                self._ended_early(rid, len(prompt), facts, "error")
                # The reason names workers' addresses and links: the operator's log has it, the
                # client (who may be anyone the API serves) gets what happened, not the topology.
                log.warning(
                    "KV transfer of %s failed (%s): the request ends with an error", rid, why
                )
                error = f"KV transfer failed (the decode worker's log has why, under {rid})"
                yield TokenDelta(rid, [], "", "abort", len(prompt), 1, error=error)
                return
            log.warning("KV transfer of %s failed (%s): prefilling it here", rid, why)
            self.num_transfer_recomputed += 1
        page_size = self.loop.engine.kv.page_size

        def add(e: LLMEngine) -> Any:
            self.keeper.note(rid, facts)
            args = (rid, prompt, pre.first_token_id, req.sampling)
            sent = {
                "arrival_time": req.arrival_time,
                "first_text_sent": len(pre.first_token_text),
                "first_logprobs": pre.first_token_logprobs,
            }
            if not ok:  # recompute: the prompt's KV is computed here
                return e.add_recomputed_request(*args, **sent)
            assert init is not None  # (pulled into)
            return e.add_prefilled_request(
                *args,
                **sent,
                num_cached_tokens=init.hit_pages * page_size,
                num_cached_host_tokens=init.host_hit_tokens,
            )

        tell_router = not ok  # (on the first delta: the router gives P's lease up)
        async with contextlib.aclosing(
            self._stream(req, add, slot, computes_prompt=not ok)
        ) as deltas:
            async for delta in deltas:
                if tell_router:
                    delta, tell_router = dataclasses.replace(delta, kv_recomputed=True), False
                yield delta

    async def _pull(
        self,
        req: GenerateRequest,
        pre: PrefillResult,
        init: ReceivePlan,
        slot: CallSlot,
        no_pull: WorkerFacts,
        transfer_start: float,
    ) -> tuple[TransferResult | None, str | None]:
        """Pull the request's KV into ``init``'s pages: (its result, or None and why it could not
        run)."""
        assert self.puller is not None
        rid, prompt_tokens = req.request_id, len(req.prompt_token_ids)
        pull = asyncio.ensure_future(
            self.puller.pull(pre.ticket, init.dst_page_ids, init.skip_pages, prompt_tokens)
        )
        self._receiving[rid] = pull
        try:
            return await asyncio.shield(pull), None
        except asyncio.CancelledError:
            # The client went away mid-receive: the pages stay held until the pull ends either
            # way, and so does the id's slot (a later call for it would meet them).
            slot.keep()
            pull.add_done_callback(lambda _: (self._free_pages(rid), slot.release()))
            gone = TransferFacts(transfer_start, time.time(), 0, None)
            self._ended_early(
                rid, prompt_tokens, dataclasses.replace(no_pull, transfer=gone), "abort"
            )
            raise
        except Exception as e:  # the pull could not run at all (the receiver closed, say)
            return None, f"{type(e).__name__}: {e}"
        finally:
            self._receiving.pop(rid, None)

    def _ended_early(
        self, rid: str, prompt_tokens: int, facts: WorkerFacts, finish: str, last: bool = False
    ) -> None:
        """Report a request that ends here before reaching the engine (from the engine thread,
        where the reporter lives; not awaited: the caller may be being cancelled). ``last``: it
        was to be prefilled here, so no prefill worker reports it."""
        self.loop.call(lambda e: self.keeper.ended_early(rid, prompt_tokens, facts, finish, last))

    def _free_pages(self, rid: str) -> Any:
        return self.loop.call(lambda e: e.kv.free(rid))

    # ---- aggregated path ----
    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Prefill locally and stream every token (aggregated mode / no healthy prefill worker)."""
        rid, prompt = req.request_id, req.prompt_token_ids.tolist()
        facts = WorkerFacts(time.time(), None, req.prefill_attempt, req.arrival_time)
        if not self._arrive(rid):
            return

        def add(e: LLMEngine) -> Any:
            self.keeper.note(rid, facts)
            return e.add_request(rid, prompt, req.sampling, arrival_time=req.arrival_time)

        async with (
            self._calls.hold(rid) as slot,
            contextlib.aclosing(self._stream(req, add, slot, computes_prompt=True)) as deltas,
        ):
            async for delta in deltas:
                yield delta

    def _stream(
        self,
        req: GenerateRequest,
        add: Callable[[LLMEngine], Any],
        slot: CallSlot,
        computes_prompt: bool,
    ) -> AsyncIterator[TokenDelta]:
        return stream_request(
            self.loop, self.keeper, req, add, slot, computes_prompt, self._token_deadline_s
        )

    def _arrive(self, rid: str) -> bool:
        """Note a request's call starting here; False when its caller already gave up on it."""
        if rid in self._gone:
            return False
        self._arrived.add(rid)
        return True

    async def abort(
        self,
        request_id: str,
        prompt_tokens: int | None = None,
        local: bool = False,
        prefill_attempt: int = 0,
    ) -> None:
        """Stop a request: a receive in flight keeps its pages until it ends; a running one is freed.

        ``prompt_tokens``: the caller had handed the request to this worker (with a prompt of
        that length; ``local``: to prefill here too; ``prefill_attempt``: the request's). If its
        call never started here (the caller's cancel stopped it before it ran), the request is
        reported as aborted now, since nothing else will report it, and a call for it that still
        comes ends at once."""
        if prompt_tokens is not None and request_id not in self._arrived:
            self._gone.add(request_id)
            gone = WorkerFacts(time.time(), None, prefill_attempt)
            self._ended_early(request_id, prompt_tokens, gone, "abort", last=local)
            return
        slot = self._calls.get(request_id)
        if slot is not None and not slot.in_engine:
            slot.aborted = True  # (its call frees its pages when it sees this)
            return
        # (with its stream ended: an aborted request makes no output, and a call still
        # streaming it would wait out decode.token_deadline_s)
        await asyncio.wrap_future(self.loop.abort(request_id, "aborted by the router"))

    def stats(self) -> WorkerStats:
        totals = transfer_totals(
            self.puller.stats() if self.puller else {},
            failures=self.num_transfer_failures,
            recomputed=self.num_transfer_recomputed,
            failed_requests=self.num_transfer_failed_requests,
        )
        return self.keeper.stats(self.loop, len(self._receiving), totals)

    def drain_stats(self) -> StatsBatch:
        return self.keeper.drain(self.stats(), self.loop, self.puller)

    def close(self) -> None:
        try:
            if self.puller is not None:
                self.puller.close()
        finally:
            self.loop.stop()
