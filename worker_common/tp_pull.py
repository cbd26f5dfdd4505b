"""TPPuller: the decode side of the KV transfer between tensor-parallel workers
(worker_common/tp_transfer.py says how the pulls pair decode and prefill ranks): every decode
rank's pulls at once, one record joined over them, and a rank whose pull may still write the
pages after rank 0 stopped waiting reported lost (the worker goes down)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.exceptions import ActorDiedError, RayActorError

from transfer import KVReceiver, TransceiverConfig
from transfer.messages import TransferTicket
from transfer.stats import TransferResult, TransferStats
from worker_common.tp_transfer import CALL_TIMEOUT_S
from worker_common.tp_transfer_stats import TPTransferBook, join_parts


class TPPuller:
    """The decode side (worker's KVPuller): rank 0's KVReceiver plus ranks 1..'s.

    A rank's pull that outlasts its transfer deadlines (pull_bound_s), or whose call Ray lost
    while the rank is not known dead (ActorUnavailableError), calls ``on_rank_lost``: the rank
    may still write the request's pages, so they cannot be freed, and the worker goes down as
    for a rank the watch finds lost (tp_ranks.take_worker_down)."""

    def __init__(
        self,
        own: KVReceiver,
        rank_actors: Sequence[Any],
        rank_config: TransceiverConfig,
        model: str,
        on_rank_lost: Callable[[str], None],
        call_slack_s: float = CALL_TIMEOUT_S,
    ) -> None:
        self.own = own
        self.rank_actors = list(rank_actors)
        self.config = rank_config
        self.on_rank_lost = on_rank_lost
        self.call_slack_s = call_slack_s
        self.book = TPTransferBook(rank_config.max_stats_len, len(self.rank_actors))
        # Start-up, before the worker serves: these calls may block.
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
        ended (none still writes any rank's pages). A rank's pull is bounded by its transfer
        deadlines (past them, the rank is lost: see the class), and a dead rank's by Ray (its
        actor dies with an error); the worker's loop awaits them, never blocks on them."""
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
                ref = self.rank_actors[part.decode_rank - 1].pull.remote(*args)
                calls.append(self._rank_pull(ref, part.decode_rank, expected_prompt_len))
        results = await asyncio.gather(*calls, return_exceptions=True)
        self.own.drain_transfer_stats()  # rank 0's part records: the join below stands for them
        records: list[tuple[str, TransferStats]] = []
        for part, res in zip(ticket.parts, results, strict=True):
            if isinstance(res, BaseException):
                error = f"{type(res).__name__}: {res}"
                res = _failed(part.ticket.request_id, error)
            heads = f"heads {part.head_start}..{part.head_start + part.head_count - 1}"
            records.append((f"decode rank {part.decode_rank} ({heads})", res.stats))
        stats = join_parts(ticket.request_id, "recv", records)
        self.book.record(stats)
        return TransferResult(ticket.request_id, stats.ok, stats.error, stats)

    async def _rank_pull(self, ref: Any, rank: int, prompt_len: int) -> TransferResult:
        bound_s = pull_bound_s(self.config, prompt_len) + self.call_slack_s
        try:
            async with asyncio.timeout(bound_s):
                return await ref
        except TimeoutError:
            self.on_rank_lost(f"decode rank {rank}'s pull did not end within {bound_s:g}s")
            raise
        except ActorDiedError:  # (dead: nothing of its pull writes the pages any more)
            raise
        except RayActorError as e:
            # The call was lost, not (known to be) the rank (ActorUnavailableError: "may or may
            # not have been executed"): its pull may still write the pages.
            self.on_rank_lost(f"decode rank {rank}'s pull call was lost: {type(e).__name__}: {e}")
            raise

    def stats(self) -> dict[str, Any]:
        """Rank 0's transceiver stats with every counter over all ranks (TPTransferBook)."""
        self.book.refresh(lambda rank: self.rank_actors[rank - 1].transfer_counters.remote())
        return self.book.stats(self.own.stats())

    def drain_transfer_stats(self) -> list[TransferStats]:
        """One joined record per request (worker_common/tp_transfer_stats.py)."""
        self.own.drain_transfer_stats()
        return self.book.drain()

    def close(self) -> None:
        self.own.close()


def pull_bound_s(config: TransceiverConfig, prompt_len: int) -> float:
    """The longest one pull of ``prompt_len`` tokens may take within ``config``'s deadlines:
    the connection, P's answer, every chunk (or a direct read's copy), the last notice."""
    chunks = -(-prompt_len // config.staging_tokens) + 1
    return (
        config.connect_deadline_s
        + config.pull_deadline_s
        + chunks * config.chunk_deadline_s
        + config.done_deadline_s
    )


def _failed(request_id: str, error: str) -> TransferResult:
    return TransferResult(
        request_id, False, error, TransferStats(request_id, "recv", 0, 0, 0.0, False, error)
    )
