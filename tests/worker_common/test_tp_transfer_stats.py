"""join_parts and TPTransferBook: a request's parts joined into one record, and counters over all
ranks (the joined records' for transfers, the ranks' own summed for the rest)."""

from __future__ import annotations

from transfer.stats import TransferCounters, TransferStats
from worker_common.tp_transfer_stats import TPTransferBook, counters_of, join_parts


def part(nbytes: int, latency: float, ok: bool = True, pages: int = 3) -> TransferStats:
    return TransferStats(
        "r|d0", "recv", nbytes, 2, latency, ok, "" if ok else "refused", "ucx",
        {"full": pages} if ok else {},
    )  # fmt: skip


def test_a_join_sums_bytes_takes_the_slowest_part_and_the_requests_pages() -> None:
    joined = join_parts("r", "recv", [("a", part(100, 0.5)), ("b", part(300, 0.2))])
    assert (joined.request_id, joined.role, joined.ok, joined.error) == ("r", "recv", True, "")
    assert (joined.bytes, joined.chunks, joined.latency_s, joined.pages) == (
        400,
        4,
        0.5,
        {"full": 3},
    )


def test_a_failed_part_fails_the_join_and_is_named() -> None:
    joined = join_parts("r", "send", [("a", part(100, 0.5)), ("b", part(0, 0.1, ok=False))])
    assert (joined.ok, joined.error, joined.pages) == (False, "b: refused", {})
    assert joined.bytes == 100


def test_counters_cover_every_rank() -> None:
    book = TPTransferBook(max_stats_len=10, num_other_ranks=2)
    book.record(join_parts("r1", "recv", [("a", part(100, 0.5)), ("b", part(300, 0.2))]))
    book.record(join_parts("r2", "recv", [("a", part(0, 0.1, ok=False))]))
    book.take_rank_counters(1, TransferCounters(transfers_ok=7, bytes=999, refused_pulls=2))
    book.take_rank_counters(2, TransferCounters(injected_faults=1, expired_leases=3))
    own = {"transfers_ok": 5, "bytes": 55, "chunks": 9, "expired_leases": 1, "peers": 2}
    stats = book.stats(own)
    # Transfers: the joined records (one per request, every rank's bytes); the rest: summed.
    assert (stats["transfers_ok"], stats["failures"], stats["bytes"], stats["chunks"]) == (
        1,
        1,
        400,
        6,
    )
    assert (stats["refused_pulls"], stats["injected_faults"], stats["expired_leases"]) == (2, 1, 4)
    assert stats["peers"] == 2 and stats["last_transfer"]["request_id"] == "r2"
    assert [s.request_id for s in book.drain()] == ["r1", "r2"] and book.drain() == []
    assert counters_of(own) == TransferCounters(
        transfers_ok=5, bytes=55, chunks=9, expired_leases=1
    )
