"""A tensor-parallel rank's lease ends (worker_common/tp_ranks.py): each ended lease goes to rank 0
with the record of the pull that served it, whichever threads end leases at once."""

from __future__ import annotations

import threading

from transfer.stats import StatsBook, TransferStats
from worker_common.tp_ranks import _TPRankActor


class _PausingSender:
    """A rank's sender, as far as ``_on_released`` reads it: its drain, which stops after draining
    on the thread named "cancel" until ``go`` is set."""

    def __init__(self) -> None:
        self.book = StatsBook(100)
        self.drained = threading.Event()
        self.go = threading.Event()

    def drain_transfer_stats(self) -> list[TransferStats]:
        out = self.book.drain()
        if threading.current_thread().name == "cancel":
            self.drained.set()
            self.go.wait(10)
        return out


def test_a_served_pulls_record_stays_with_its_lease_when_another_lease_ends_meanwhile() -> None:
    # The loop serves X's pull and records it, then ends X's lease; meanwhile a cancel on one of
    # Ray's threads ends lease Y, and its drain takes X's record. X's end must still get it (it
    # got None, and rank 0 counted a served pull as failed).
    rank = object.__new__(_TPRankActor)
    rank.name = "rank 1"
    rank._init_transfer()
    sender = rank._sender = _PausingSender()
    record = TransferStats("x|d0", "send", 100, 1, 0.01, True)
    sender.book.record(record)
    cancel = threading.Thread(target=rank._on_released, args=("y|d0",), name="cancel")
    cancel.start()
    assert sender.drained.wait(10)
    served = threading.Thread(target=rank._on_released, args=("x|d0",), name="loop")
    served.start()
    served.join(0.5)  # (it waits for the lock the cancel holds; it used to run through)
    sender.go.set()
    cancel.join(10)
    served.join(10)
    assert {e.sub: e.record for e in rank._ended} == {"y|d0": None, "x|d0": record}
    assert rank._records == {}
