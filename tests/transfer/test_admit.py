"""admit (transfer/admit.py): the prefill side's checks of a PullRequest before it serves it or
refuses it. A refusal completes every receive D credited, so credits that no honest decode worker
sends (repeated, out of range, more chunks than pages) are refused as a conflict, which completes
nothing, whatever the state of the lease: one small frame of repeated credits for a request P
never published made P build a million sends."""

from __future__ import annotations

import types

from tests.transfer.conftest import MODEL, specs
from transfer.admit import admit
from transfer.leases import LeaseTable
from transfer.messages import PullError, PullRequest
from transfer.page_table import PageTable
from transfer.stats import TransferCounters

TABLE = PageTable.from_specs(MODEL, specs())


def answer(ready: list[int], num_chunks: int = 2, dst: int = 4, rid: str = "unknown") -> PullError:
    leases = LeaseTable(lambda lease: None)
    leases.publish("known", {"full": [1, 2, 3, 4]}, 16, lease_s=10)
    link = types.SimpleNamespace(info=types.SimpleNamespace(chunk_bytes=1 << 20, page_table=TABLE))
    req = PullRequest(
        rid, 7, {"full": [1, 2, 3, 4]}, {"full": list(range(5, 5 + dst))}, 0, 1 << 20,
        num_chunks, 0, ready, 1,
    )  # fmt: skip
    out = admit(leases, TABLE, TransferCounters(), link, req, False)
    assert isinstance(out, PullError)
    return out


def test_credits_no_honest_pull_sends_are_a_conflict_whatever_the_lease() -> None:
    for rid in ("unknown", "known"):
        assert answer([0] * 100_000, rid=rid).code == "conflict"  # repeated
        assert answer([0, 5], rid=rid).code == "conflict"  # past the plan's chunks
        assert answer([-1], rid=rid).code == "conflict"
        assert answer([0], num_chunks=1 << 62, rid=rid).code == "conflict"  # more chunks than pages


def test_honest_credits_of_an_unknown_request_get_its_answer() -> None:
    out = answer([0, 1])
    assert out.code == "unknown" and "never published" in out.reason  # (its receives drained)
