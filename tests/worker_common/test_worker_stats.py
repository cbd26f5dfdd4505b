"""transfer_totals (worker_common/worker_stats.py): a transceiver's stats() counters become the
worker's TransferTotals field for field, as /metrics exports them."""

from __future__ import annotations

import dataclasses

from worker_common.messages import TransferTotals
from worker_common.worker_stats import transfer_totals


def test_every_counter_of_the_transceiver_reaches_the_totals() -> None:
    own = [f.name for f in dataclasses.fields(TransferTotals)]
    counters = {name: i + 1 for i, name in enumerate(own)}  # all distinct
    got = transfer_totals(counters, recomputed=counters["recomputed"],
                          failed_requests=counters["failed_requests"])  # fmt: skip
    assert dataclasses.asdict(got) == counters
    assert transfer_totals(counters, failures=99).failures == 99  # (D counts its own)
