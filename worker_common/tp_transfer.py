"""The KV transfer between tensor-parallel workers: prefill tp ``a``, decode tp ``b`` (either may
be 1).

Each decode rank reads the KV heads it holds from the prefill ranks that hold them (each head from
its lowest prefill rank: a replicated head from its primary), one pull per (decode rank, prefill
rank) pair. Every pair has a lease of its own on its prefill rank, under the sub-id
``<request id>|d<decode rank>``, so a lease still has exactly one reader (transfer/leases.py);
the prefill worker's pages are freed once every one of the request's leases, on every rank, has
ended. The ticket the router carries is rank 0's, with one TicketPart per pair.

``TPPublisher`` and ``TPPuller`` stand where a plain KVSender / KVReceiver stands in the workers;
ranks 1.. run their own sender or receiver over their own pools (worker_common/tp_ranks.py).
A failed pull on any decode rank fails the request on the decode worker (it frees its pages once
every pull has ended); every prefill-side lease ends by its pull's final notice or its expiry.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from kvcache.head_shard import head_shards
from transfer import KVReceiver, KVSender, TransceiverConfig
from transfer.messages import TicketPart, TransferTicket
from transfer.stats import TransferResult, TransferStats

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0  # a rank's publish or cancel; longer means the rank is lost


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


def sub_id(request_id: str, decode_rank: int) -> str:
    return f"{request_id}|d{decode_rank}"


def parent_id(sub: str) -> str:
    return sub.rsplit("|d", 1)[0]


class TPPublisher:
    """The prefill side (worker's KVPublisher): rank 0's KVSender plus ranks 1..'s."""

    def __init__(
        self,
        make_own: Callable[[Callable[[str], None]], KVSender],
        rank_actors: Sequence[Any],
        reads: list[Read],
        release: Callable[[str], None],
        rank_config: TransceiverConfig,
        model: str,
    ) -> None:
        self.rank_actors = list(rank_actors)
        self.reads = reads
        self._release = release
        self._lock = threading.Lock()
        self._open: dict[str, set[tuple[int, str]]] = {}  # request -> (prefill rank, sub id) open
        self._subs: dict[str, list[tuple[int, str]]] = {}
        self.own = make_own(lambda sub: self._ended(0, sub))
        for actor in self.rank_actors:
            ray.get(actor.start_sender.remote(rank_config, model), timeout=CALL_TIMEOUT_S)

    def publish(
        self, request_id: str, page_ids: dict[str, list[int]], declared_prompt_len: int
    ) -> TransferTicket:
        subs = [(r.prefill_rank, sub_id(request_id, r.decode_rank)) for r in self.reads]
        with self._lock:
            self._open[request_id] = set(subs)
            self._subs[request_id] = subs
        parts: list[TicketPart] = []
        try:
            for read, (rank, sub) in zip(self.reads, subs, strict=True):
                heads = (read.head_start, read.head_count)
                if rank == 0:
                    ticket = self.own.publish(sub, page_ids, declared_prompt_len, heads)
                else:
                    actor = self.rank_actors[rank - 1]
                    ticket = ray.get(
                        actor.publish.remote(sub, page_ids, declared_prompt_len, heads),
                        timeout=CALL_TIMEOUT_S,
                    )
                    ended = actor.wait_released.remote(sub)
                    ended.future().add_done_callback(
                        lambda _f, rank=rank, sub=sub: self._ended(rank, sub)
                    )
                parts.append(TicketPart(read.decode_rank, read.head_start, read.head_count, ticket))
        except BaseException:
            with self._lock:  # the worker frees the pages itself (its publish failed)
                self._open.pop(request_id, None)
            self._cancel_subs(subs[: len(parts)])
            raise
        return dataclasses.replace(parts[0].ticket, request_id=request_id, parts=tuple(parts))

    def _ended(self, rank: int, sub: str) -> None:
        rid = parent_id(sub)
        with self._lock:
            left = self._open.get(rid)
            if left is None:
                return
            left.discard((rank, sub))
            if left:
                return
            del self._open[rid]
            self._subs.pop(rid, None)
        self._release(rid)

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            subs = list(self._subs.get(request_id, []))
        return self._cancel_subs(subs)

    def _cancel_subs(self, subs: list[tuple[int, str]]) -> bool:
        done = True
        for rank, sub in subs:
            try:
                if rank == 0:
                    done = self.own.cancel(sub) and done
                else:
                    call = self.rank_actors[rank - 1].cancel.remote(sub)
                    done = ray.get(call, timeout=CALL_TIMEOUT_S) and done
            except Exception:  # a lost rank takes the worker down; nothing to cancel there
                log.warning("cancel of %s on prefill rank %d failed", sub, rank, exc_info=True)
                done = False
        return done

    def stats(self) -> dict[str, Any]:
        return self.own.stats()

    def drain_transfer_stats(self) -> list[TransferStats]:
        return self.own.drain_transfer_stats()

    def close(self) -> None:
        self.own.close()


class TPPuller:
    """The decode side (worker's KVPuller): rank 0's KVReceiver plus ranks 1..'s."""

    def __init__(
        self,
        own: KVReceiver,
        rank_actors: Sequence[Any],
        rank_config: TransceiverConfig,
        model: str,
    ) -> None:
        self.own = own
        self.rank_actors = list(rank_actors)
        for actor in self.rank_actors:
            ray.get(actor.start_receiver.remote(rank_config, model), timeout=CALL_TIMEOUT_S)

    async def pull(
        self,
        ticket: TransferTicket,
        dst_page_ids: dict[str, list[int]],
        skip_pages: int | dict[str, int],
        expected_prompt_len: int,
    ) -> TransferResult:
        """Every decode rank's pulls at once; ok only when all are. Returns once every pull has
        ended (none still writes any rank's pages)."""
        if not ticket.parts:
            return _failed(
                ticket.request_id,
                "the ticket has no per-rank parts (a tp 1 prefill "
                "worker of another configuration?)",
            )
        calls = []
        for part in ticket.parts:
            heads = (part.head_start, part.head_count)
            args = (part.ticket, dst_page_ids, skip_pages, expected_prompt_len, heads)
            if part.decode_rank == 0:
                calls.append(self.own.pull(*args))
            else:
                calls.append(_await_ref(self.rank_actors[part.decode_rank - 1].pull.remote(*args)))
        results = await asyncio.gather(*calls, return_exceptions=True)
        errors, nbytes, chunks, latency, path = [], 0, 0, 0.0, "ucx"
        pages: dict[str, int] = {}  # every part moves a head slice of the same pages
        for part, res in zip(ticket.parts, results, strict=True):
            if isinstance(res, BaseException):
                errors.append(f"decode rank {part.decode_rank}: {type(res).__name__}: {res}")
                continue
            nbytes += res.stats.bytes
            chunks += res.stats.chunks
            latency = max(latency, res.stats.latency_s)
            path = res.stats.path
            pages = res.stats.pages
            if not res.ok:
                errors.append(f"decode rank {part.decode_rank}: {res.error}")
        ok = not errors
        error = "; ".join(errors)
        stats = TransferStats(
            ticket.request_id, "recv", nbytes, chunks, latency, ok, error, path,
            pages if ok else {},
        )  # fmt: skip
        return TransferResult(ticket.request_id, ok, error, stats)

    def stats(self) -> dict[str, Any]:
        return self.own.stats()

    def drain_transfer_stats(self) -> list[TransferStats]:
        return self.own.drain_transfer_stats()

    def close(self) -> None:
        self.own.close()


async def _await_ref(ref: Any) -> TransferResult:
    return await ref


def _failed(request_id: str, error: str) -> TransferResult:
    return TransferResult(
        request_id, False, error, TransferStats(request_id, "recv", 0, 0, 0.0, False, error)
    )
