"""The KV transfer between tensor-parallel workers: prefill tp ``a``, decode tp ``b`` (either may
be 1).

Each decode rank reads the KV heads it holds from the prefill ranks that hold them (each head from
its lowest prefill rank: a replicated head from its primary), one pull per (decode rank, prefill
rank) pair. Every pair has a lease of its own on its prefill rank, under the sub-id
``<request id>|d<decode rank>``, so a lease still has exactly one reader (transfer/leases.py);
the prefill worker's pages are freed once every one of the request's leases, on every rank, has
ended. The ticket the router carries is rank 0's, with one TicketPart per pair.

Rank 0 reaches the other ranks only by awaiting their answers on the worker's loop (a publish or
cancel within ``CALL_TIMEOUT_S``; a pull within its transfer deadlines), never by blocking it; a
rank that does not answer fails the call (a rank that is lost, not merely slow, the rank watch
takes the worker down: worker_common/tp_ranks.py), and a lease it publishes after its failed
publish is ended when it answers. The parts' transfer records are joined into one per request and the
counters cover every rank (worker_common/tp_transfer_stats.py).

Rank 0 learns which of another rank's leases ended from one ``released`` call open per rank at
a time (answered as leases end, or empty after RELEASED_WAIT_S), not one call per lease: each call
holds one of the rank actor's threads while it waits. A rank that is lost fails its open parts.

``TPPublisher`` (here) and ``TPPuller`` (worker_common/tp_pull.py) stand where a plain KVSender /
KVReceiver stands in the workers;
ranks 1.. run their own sender or receiver over their own pools (worker_common/tp_ranks.py).
A failed pull on any decode rank fails the request on the decode worker (it frees its pages once
every pull has ended); every prefill-side lease ends by its pull's final notice, the router's
cancel (a failed or recomputed request) or its expiry.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorDiedError

from kvcache.head_shard import head_shards
from transfer import KVSender, TransceiverConfig
from transfer.messages import TicketPart, TransferTicket
from transfer.stats import TransferStats
from worker_common.tp_ranks import LeaseEnded
from worker_common.tp_transfer_stats import TPTransferBook, join_parts

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0  # a rank's publish or cancel; longer means the rank is lost
RELEASED_WAIT_S = 5.0  # how long one ``released`` call waits on its rank for a lease to end
RELEASED_RETRY_S = 1.0  # before a ``released`` call that failed (the rank not lost) is made again


@dataclass(frozen=True)
class Read:
    """Decode rank ``decode_rank`` reads heads [head_start, head_start + head_count) from
    prefill rank ``prefill_rank``."""

    decode_rank: int
    prefill_rank: int
    head_start: int
    head_count: int


def plan_reads(num_kv_heads: int, prefill_tp: int, decode_tp: int) -> list[Read]:
    """Every (decode rank, prefill rank) read, in decode rank order."""
    sources = head_shards(num_kv_heads, prefill_tp)
    reads: list[Read] = []
    for d, shard in enumerate(head_shards(num_kv_heads, decode_tp)):
        for head in range(shard.start, shard.stop):
            p = next(r for r, s in enumerate(sources) if s.start <= head < s.stop)
            last = reads[-1] if reads else None
            if last and (last.decode_rank, last.prefill_rank) == (d, p):
                reads[-1] = dataclasses.replace(last, head_count=last.head_count + 1)
            else:
                reads.append(Read(d, p, head, 1))
    return reads


def rank_listener(config: TransceiverConfig, rank: int) -> TransceiverConfig:
    """Rank ``rank``'s transceiver settings: the ranks of a worker share a node, so each listens
    on a port of its own, ``transfer.port + rank`` (a range a firewall can open), any free one
    when transfer.port is 0."""
    return dataclasses.replace(config, port=config.port + rank if config.port else 0)


def sub_id(request_id: str, decode_rank: int) -> str:
    return f"{request_id}|d{decode_rank}"


def parent_id(sub: str) -> str:
    return sub.rsplit("|d", 1)[0]


class TPPublisher:
    """The prefill side (worker's KVPublisher): rank 0's KVSender plus ranks 1..'s. ``publish``
    and ``cancel`` are coroutines: they await the other ranks' answers on the worker's loop (each
    within ``call_timeout_s``; a rank that does not answer fails the call, and a lost one the
    rank watch takes the worker down), never block it."""

    def __init__(
        self,
        make_own: Callable[[Callable[[str], None]], KVSender],
        rank_actors: Sequence[Any],
        reads: list[Read],
        release: Callable[[str], None],
        rank_config: TransceiverConfig,
        model: str,
        call_timeout_s: float = CALL_TIMEOUT_S,
    ) -> None:
        self.rank_actors = list(rank_actors)
        self.reads = reads
        self.call_timeout_s = call_timeout_s
        self._release = release
        self._lock = threading.Lock()
        self._open: dict[str, set[tuple[int, str]]] = {}  # request -> (prefill rank, sub id) open
        self._subs: dict[str, list[tuple[int, str]]] = {}
        # request -> the records of its ended parts, each with its prefill rank
        self._records: dict[str, list[tuple[int, TransferStats]]] = {}
        self.book = TPTransferBook(rank_config.max_stats_len, len(self.rank_actors))
        self._own_records: dict[str, TransferStats] = {}
        self.own = make_own(lambda sub: self._ended(0, sub, self._own_record(sub)))
        # Start-up, before the worker serves: these calls may block.
        for rank, actor in enumerate(self.rank_actors, start=1):
            ray.get(
                actor.start_sender.remote(rank_listener(rank_config, rank), model),
                timeout=CALL_TIMEOUT_S,
            )
        self._closed = False
        for rank in range(1, len(self.rank_actors) + 1):
            self._ask_released(rank)

    async def publish(
        self, request_id: str, page_ids: dict[str, list[int]], declared_prompt_len: int
    ) -> TransferTicket:
        subs = [(r.prefill_rank, sub_id(request_id, r.decode_rank)) for r in self.reads]
        with self._lock:
            self._open[request_id] = set(subs)
            self._subs[request_id] = subs
            self._records[request_id] = []
        parts: dict[int, TicketPart] = {}
        published: list[tuple[int, str]] = []
        remote: list[tuple[int, Read, int, str, Any]] = []
        try:
            for i, (read, (rank, sub)) in enumerate(zip(self.reads, subs, strict=True)):
                heads = (read.head_start, read.head_count)
                if rank == 0:
                    ticket = self.own.publish(sub, page_ids, declared_prompt_len, heads)
                    published.append((rank, sub))
                    parts[i] = TicketPart(read.decode_rank, *heads, ticket)
                else:
                    actor = self.rank_actors[rank - 1]
                    ref = actor.publish.remote(sub, page_ids, declared_prompt_len, heads)
                    remote.append((i, read, rank, sub, ref))
            answers = await asyncio.gather(
                *(self._call(ref) for *_, ref in remote), return_exceptions=True
            )
            failed: BaseException | None = None
            for (i, read, rank, sub, _), answer in zip(remote, answers, strict=True):
                if isinstance(answer, BaseException):
                    failed = failed or answer
                    continue
                published.append((rank, sub))
                parts[i] = TicketPart(read.decode_rank, read.head_start, read.head_count, answer)
            if failed is not None:
                raise failed
        except BaseException:
            with self._lock:  # the worker frees the pages itself (its publish failed)
                self._open.pop(request_id, None)
                self._subs.pop(request_id, None)
                self._records.pop(request_id, None)
            # A rank that did not answer (timed out, or this publish was cancelled) may still
            # publish: its lease is ended when it does, or it would hold the request id (a retry
            # of the request here was refused as already published) until it expired.
            for _, _, rank, sub, ref in remote:
                if (rank, sub) not in published:
                    ref.future().add_done_callback(functools.partial(self._end_late, rank, sub))
            await self._cancel_subs(published)
            raise
        ordered = [parts[i] for i in range(len(self.reads))]
        return dataclasses.replace(ordered[0].ticket, request_id=request_id, parts=tuple(ordered))

    def _end_late(self, rank: int, sub: str, answer: concurrent.futures.Future) -> None:
        """Rank ``rank`` published ``sub`` after its publish had failed: end that lease (its
        generation alone: never a later publish of the request). On Ray's callback thread."""
        if answer.cancelled() or answer.exception() is not None:
            return  # (not published: nothing to end)
        ticket = answer.result()
        ended = self.rank_actors[rank - 1].cancel.remote(sub, ticket.lease_gen)

        def heard(f: concurrent.futures.Future) -> None:
            if f.exception() is not None:  # (a lost rank: the rank watch's to find)
                log.warning(
                    "ending a late lease of %s on rank %d failed: %s", sub, rank, f.exception()
                )

        ended.future().add_done_callback(heard)

    async def _call(self, ref: Any) -> Any:
        """Another rank's answer; TimeoutError when it gives none in ``call_timeout_s``."""
        try:
            async with asyncio.timeout(self.call_timeout_s):  # (not wait_for: it may lose a cancel)
                return await ref
        except TimeoutError:
            raise TimeoutError(
                f"a prefill rank did not answer within {self.call_timeout_s}s (lost?)"
            ) from None

    def _ask_released(self, rank: int) -> None:
        """Ask rank ``rank`` which of its leases ended, and again once it answers: one call open
        per rank, answered by the Ray callback thread (never the worker's loop)."""
        if self._closed:
            return
        ref = self.rank_actors[rank - 1].released.remote(RELEASED_WAIT_S)
        ref.future().add_done_callback(lambda f: self._took_released(rank, f))

    def _took_released(self, rank: int, answer: Any) -> None:
        error = answer.exception()
        if self._closed:
            return
        if isinstance(error, ActorDiedError):
            # The rank is dead (the rank watch takes the worker down): none of its open leases
            # will end by a notice, and nothing of it reads the pages, so its parts fail now and
            # the pages are freed.
            self._fail_parts_of(rank, f"the rank was lost: {type(error).__name__}: {error}")
            return
        if error is not None:
            # Not known dead (ActorUnavailableError: this call was lost on the way, the rank may
            # well be serving its leases still): they still end by a notice, so ask again soon;
            # a rank that is gone is the rank watch's to find.
            log.warning("prefill rank %d did not say which leases ended: %s", rank, error)
            retry = threading.Timer(RELEASED_RETRY_S, self._ask_released, (rank,))
            retry.daemon = True
            retry.start()
            return
        ended: LeaseEnded
        for ended in answer.result():
            self._ended(rank, ended.sub, ended.record)
        self._ask_released(rank)

    def _fail_parts_of(self, rank: int, error: str) -> None:
        with self._lock:
            subs = [sub for left in self._open.values() for r, sub in left if r == rank]
        for sub in subs:
            self._ended(rank, sub, _failed_send(sub, error))

    def _own_record(self, sub: str) -> TransferStats | None:
        # Rank 0's lease ended (the transceiver records a served pull before it ends the lease):
        # its records go to the joins, and only the joins go out.
        with self._lock:
            for s in self.own.drain_transfer_stats():
                self._own_records[s.request_id] = s
            return self._own_records.pop(sub, None)

    def _ended(self, rank: int, sub: str, record: TransferStats | None) -> None:
        rid = parent_id(sub)
        with self._lock:
            left = self._open.get(rid)
            if left is None:
                return
            left.discard((rank, sub))
            records = self._records[rid]
            if record is not None:
                records.append((rank, record))
            if left:
                return
            del self._open[rid]
            subs = self._subs.pop(rid, [])
            del self._records[rid]
        if records:  # no part was served (expired, cancelled): no transfer to record, as at tp 1
            # (With decode tp 1 every prefill rank's part has the same sub id: keyed by rank too.)
            served = {(rank, s.request_id) for rank, s in records}
            unserved = [
                (rank, _failed_send(sub, "its lease ended unserved"))
                for rank, sub in subs
                if (rank, sub) not in served
            ]
            named = [(_send_part(rank, s.request_id), s) for rank, s in records + unserved]
            self.book.record(join_parts(rid, "send", named))
        self._release(rid)

    async def cancel(self, request_id: str) -> bool:
        with self._lock:
            subs = list(self._subs.get(request_id, []))
        return await self._cancel_subs(subs)

    async def _cancel_subs(self, subs: list[tuple[int, str]]) -> bool:
        async def one(rank: int, sub: str) -> bool:
            try:
                if rank == 0:
                    return self.own.cancel(sub)
                return bool(await self._call(self.rank_actors[rank - 1].cancel.remote(sub)))
            except Exception:  # a lost rank takes the worker down; nothing to cancel there
                log.warning("cancel of %s on prefill rank %d failed", sub, rank, exc_info=True)
                return False

        return all(await asyncio.gather(*(one(rank, sub) for rank, sub in subs)))

    def stats(self) -> dict[str, Any]:
        """Rank 0's transceiver stats with every counter over all ranks (TPTransferBook)."""
        self.book.refresh(lambda rank: self.rank_actors[rank - 1].transfer_counters.remote())
        return self.book.stats(self.own.stats())

    def drain_transfer_stats(self) -> list[TransferStats]:
        """One joined record per request (worker_common/tp_transfer_stats.py)."""
        return self.book.drain()

    def close(self) -> None:
        self._closed = True  # (the open ``released`` calls end within RELEASED_WAIT_S)
        self.own.close()


def _send_part(prefill_rank: int, sub: str) -> str:
    return f"prefill rank {prefill_rank} for decode rank {sub.rsplit('|d', 1)[1]}"


def _failed_send(sub: str, error: str) -> TransferStats:
    return TransferStats(sub, "send", 0, 0, 0.0, False, error)
