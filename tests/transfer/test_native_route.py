"""NativeRoute (transfer/native_route.py): the quick checks of a read the C launcher queued give
the general checks' answers. Its digest of a slot's ids is the lease board's digest of the same
ticket, and its byte count is the plan's; ids that are not plainly valid get no quick answer.
The launcher's own part (bounds and repeats) runs on GPUs: tests/transfer/test_direct_copy_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

from tests.transfer.conftest import MODEL, specs
from transfer.lease_board import lease_digest
from transfer.native_route import NativeRoute
from transfer.page_table import PageTable
from transfer.plan import IdPair, checked_direct_plan


def launched(route: NativeRoute, ids: dict[str, tuple[list[int], list[int]]]):
    """A slot as the C launcher fills it (pairs in route order, each at an even offset) and the
    stats it returns: (n, source bounds, destination bounds, destination repeats)."""
    slot = np.zeros((2, 64), dtype=np.int64)
    stats, at = [], 0
    for sp, _, _ in route.pairs:
        s, d = (np.asarray(x, dtype=np.int64) for x in ids[sp])
        slot[0, at : at + len(s)], slot[1, at : at + len(d)] = s, d
        repeats = int(len(set(d.tolist())) != len(d))
        stats.append((len(s), int(s.min()), int(s.max()), int(d.min()), int(d.max()), repeats))
        at += len(s) + len(s) % 2
    return slot, tuple(stats)


@pytest.fixture
def tables() -> tuple[PageTable, PageTable]:
    src = PageTable.from_specs(MODEL, specs(num_pages=40, two_groups=True))
    dst = PageTable.from_specs(MODEL, specs(num_pages=30, two_groups=True))
    return src, dst


def route_of(src: PageTable, dst: PageTable) -> NativeRoute:
    # "full" launched first: launch order and name order (the digest's) differ.
    return NativeRoute((("full", "full", None), ("extra", "extra", None)), src, dst)


def test_quick_answers_equal_the_general_checks(tables) -> None:
    src, dst = tables
    route = route_of(src, dst)
    ids = {"full": ([5, 39, 2], [7, 1, 29]), "extra": ([3, 4, 8, 9, 11], [2, 3, 4, 5, 6])}
    slot, stats = launched(route, ids)
    ticket_pages = {g: s for g, (s, _) in ids.items()}
    assert route.digest("req-1", slot[0], stats) == lease_digest("req-1", ticket_pages)
    assert route.digest("req-2", slot[0], stats) != lease_digest("req-1", ticket_pages)
    pairs = {
        (g, g): IdPair(np.asarray(s), np.asarray(d), min(s), max(s), min(d), max(d), 0)
        for g, (s, d) in ids.items()
    }
    assert route.plain_bytes(stats) == checked_direct_plan(src, dst, pairs).total_bytes


@pytest.mark.parametrize(
    "full",
    [
        ([5, 40, 2], [7, 1, 29]),  # a source page past P's pool
        ([5, 6, 2], [7, 1, 30]),  # a destination page past ours
        ([0, 6, 2], [7, 1, 3]),  # the null page
        ([5, 6, 2], [7, 1, 0]),
        ([5, 6, 2], [7, 1, 7]),  # one destination page twice
    ],
)
def test_ids_not_plainly_valid_get_no_quick_answer(tables, full) -> None:
    src, dst = tables
    route = route_of(src, dst)
    _, stats = launched(route, {"full": full, "extra": ([3], [2])})
    assert route.plain_bytes(stats) is None


def test_a_pool_with_no_pages_gets_no_quick_answer(tables) -> None:
    src, dst = tables
    route = route_of(src, dst)
    _, stats = launched(route, {"full": ([5], [7]), "extra": ([3], [2])})
    assert route.plain_bytes((stats[0], (0, 0, 0, 0, 0, 0))) is None
