"""Plans: fragments cut at page boundaries into chunks of at most one staging buffer, and the
direct-copy plan of page id pairs."""

from __future__ import annotations

import numpy as np
import pytest

from kernels import native_launch
from tests.transfer.conftest import MODEL, specs
from transfer.mapper import Fragment, MapperError
from transfer.page_table import PageTable
from transfer.plan import (
    DIRECT_MAX_BYTES,
    Chunk,
    IdPair,
    build_plan,
    checked_direct_plan,
    chunk_bytes_for,
    chunk_fragments,
    direct_plan,
    unchecked_direct_pairs,
)

PB = 100


def test_short_runs_fill_chunks_split_at_page_boundaries() -> None:
    frags = [
        Fragment("a", "a", 0, 1000, PB),
        Fragment("a", "a", 500, 0, PB),
        Fragment("a", "a", 900, 300, 2 * PB),
    ]
    plan = chunk_fragments(frags, 3 * PB, {"a": PB})
    assert [c.fragments for c in plan.chunks] == [
        (
            Fragment("a", "a", 0, 1000, PB),
            Fragment("a", "a", 500, 0, PB),
            Fragment("a", "a", 900, 300, PB),
        ),
        (Fragment("a", "a", 1000, 400, PB),),
    ]
    assert [c.index for c in plan.chunks] == [0, 1]
    assert [c.contiguous for c in plan.chunks] == [False, True]
    assert plan.total_bytes == 4 * PB and plan.num_chunks == 2


def test_long_runs_become_direct_chunks_of_their_own() -> None:
    frags = [
        Fragment("a", "a", 0, 0, PB),
        Fragment("a", "a", 1000, 5000, 5 * PB),
        Fragment("a", "a", 200, 9000, PB),
    ]
    plan = chunk_fragments(frags, 2 * PB, {"a": PB})
    assert [c.fragments for c in plan.chunks] == [
        (Fragment("a", "a", 0, 0, PB),),
        (Fragment("a", "a", 1000, 5000, 5 * PB),),
        (Fragment("a", "a", 200, 9000, PB),),
    ]
    big = plan.chunks[1]
    for straight in (Chunk.sends_straight, Chunk.receives_straight):
        assert straight(big, zero_copy=False, staging_bytes=2 * PB)  # it cannot fit a buffer
        assert not straight(plan.chunks[0], zero_copy=False, staging_bytes=2 * PB)
        assert straight(plan.chunks[0], zero_copy=True, staging_bytes=2 * PB)


def test_a_side_whose_pages_are_one_run_skips_its_copy() -> None:
    # P's pages 0..2 in order, D's scattered: P sends from its pool, D scatters.
    src_run = Chunk(
        0, tuple(Fragment("a", "a", i * PB, d * PB, PB) for i, d in enumerate([7, 2, 5]))
    )
    assert src_run.src_run == ("a", 0) and src_run.dst_run is None and not src_run.contiguous
    assert src_run.sends_straight(zero_copy=True, staging_bytes=4 * PB)
    assert not src_run.receives_straight(zero_copy=True, staging_bytes=4 * PB)
    assert not src_run.sends_straight(zero_copy=False, staging_bytes=4 * PB)
    # The mirror: D's pages 4..6 in order.
    dst_run = Chunk(
        0, tuple(Fragment("a", "b", s * PB, (4 + i) * PB, PB) for i, s in enumerate([3, 0, 9]))
    )
    assert dst_run.dst_run == ("b", 4 * PB) and dst_run.src_run is None
    assert dst_run.receives_straight(zero_copy=True, staging_bytes=4 * PB)
    assert not dst_run.sends_straight(zero_copy=True, staging_bytes=4 * PB)
    # Adjacent bytes of two pools, or pages out of order, are not one run.
    two_pools = Chunk(0, (Fragment("a", "a", 0, 0, PB), Fragment("b", "a", PB, PB * 3, PB)))
    assert two_pools.src_run is None
    backwards = Chunk(0, (Fragment("a", "a", PB, 0, PB), Fragment("a", "a", 0, PB, PB)))
    assert backwards.src_run is None and backwards.dst_run == ("a", 0)


def test_direct_chunks_are_capped_at_one_gibibyte() -> None:
    plan = chunk_fragments(
        [Fragment("a", "a", 0, 0, 2 * DIRECT_MAX_BYTES + 4 * 4096)], 8192, {"a": 4096}
    )
    assert [c.nbytes for c in plan.chunks] == [DIRECT_MAX_BYTES, DIRECT_MAX_BYTES, 4 * 4096]


def test_chunk_size_that_is_not_a_page_multiple_rounds_down() -> None:
    frags = [Fragment("a", "a", i * 2 * PB, 0, PB) for i in range(3)]
    plan = chunk_fragments(frags, 2 * PB + 50, {"a": PB})
    assert [c.nbytes for c in plan.chunks] == [2 * PB, PB]


def test_page_larger_than_a_chunk_is_an_error() -> None:
    with pytest.raises(ValueError, match="larger than a chunk"):
        chunk_fragments([Fragment("a", "a", 0, 0, PB)], PB - 1, {"a": PB})


def test_empty_transfer_has_no_chunks() -> None:
    table = PageTable.from_specs(MODEL, specs())
    plan = build_plan(table, table, {"full": []}, {"full": []}, 4096)
    assert plan.num_chunks == 0 and plan.total_bytes == 0


def test_chunk_bytes_hold_staging_tokens_of_every_pool() -> None:
    table = PageTable.from_specs(MODEL, specs(two_groups=True))
    assert chunk_bytes_for(table, 10) == 2 * (table.pools[0].page_bytes + table.pools[1].page_bytes)
    with pytest.raises(ValueError, match="at least one page"):
        chunk_bytes_for(table, 3)


def test_direct_plan_pairs_pages_across_pools_and_checks_them() -> None:
    table = PageTable.from_specs("m", specs(two_groups=True))
    full, extra = (p.page_bytes for p in table.pools)
    plan = direct_plan(
        table, table, {"full": [5, 0, 9], "extra": [2]}, {"full": [1, 2, 3], "extra": [7]}
    )
    # The null page moves nothing (a sliding window dropped it): its destination is left out.
    assert [(sp, dp, s.tolist(), d.tolist()) for sp, dp, s, d in plan.pairs] == [
        ("full", "full", [5, 9], [1, 3]),
        ("extra", "extra", [2], [7]),
    ]
    assert plan.total_bytes == 2 * full + extra
    with pytest.raises(MapperError, match="listed twice"):
        direct_plan(table, table, {"full": [5, 6], "extra": []}, {"full": [1, 1], "extra": []})
    with pytest.raises(MapperError, match="outside"):
        direct_plan(table, table, {"full": [5], "extra": []}, {"full": [10**6], "extra": []})


def test_unchecked_pairs_line_up_pools_and_counts_only() -> None:
    table = PageTable.from_specs("m", specs(two_groups=True))
    src = {"full": np.array([4, 5, 0, 9]), "extra": np.array([8, 2])}
    dst = {"full": np.array([1, 2, 3]), "extra": np.array([7])}
    pairs = unchecked_direct_pairs(table, table, src, dst, skip=1)
    assert [(sp, dp, s.tolist(), d.tolist()) for sp, dp, s, d in pairs] == [
        ("full", "full", [5, 0, 9], [1, 2, 3]),  # the null page is the kernel's to skip
        ("extra", "extra", [2], [7]),
    ]
    # Ids are not checked here (the copy kernel skips ids outside the pools) ...
    far = unchecked_direct_pairs(
        table,
        table,
        {"full": np.array([10**6]), "extra": src["extra"][:0]},
        {"full": np.array([3]), "extra": dst["extra"][:0]},
        0,
    )
    assert far is not None
    # ... but pools and counts that do not line up give None (direct_plan then says why).
    assert unchecked_direct_pairs(table, table, src, dst, skip=0) is None
    assert unchecked_direct_pairs(table, table, {"full": src["full"]}, dst, skip=1) is None
    assert (
        unchecked_direct_pairs(table, table, src, {"full": dst["full"], "x": dst["extra"]}, 1)
        is None
    )
    assert unchecked_direct_pairs(table, table, src, dst, skip=-1) is None


def _pair(s: list[int], d: list[int], repeats: int | None = None) -> IdPair:
    """Ids with the bounds a launcher would report (``repeats`` as it would, unless given)."""
    sa, da = np.array(s, dtype=np.int64), np.array(d, dtype=np.int64)
    if repeats is None:
        repeats = int(len(set(d)) != len(d))
    return IdPair(
        sa, da, min(s, default=0), max(s, default=0), min(d, default=0), max(d, default=0), repeats
    )


def test_checked_plan_of_launched_ids_agrees_with_direct_plan() -> None:
    table = PageTable.from_specs("m", specs(two_groups=True))
    cases = [
        ({"full": [5, 6, 9], "extra": [2]}, {"full": [1, 2, 3], "extra": [7]}),  # plainly valid
        ({"full": [5, 0, 9], "extra": [2]}, {"full": [1, 2, 3], "extra": [7]}),  # a null page
        ({"full": [], "extra": [2]}, {"full": [], "extra": [7]}),
    ]
    for s, d in cases:
        want = direct_plan(table, table, s, d)
        got = checked_direct_plan(
            table, table, {(g, g): _pair(s[g], d[g]) for g in ("full", "extra")}
        )
        assert got.total_bytes == want.total_bytes
        assert [(a, b, x.tolist(), y.tolist()) for a, b, x, y in got.pairs] == [
            (a, b, x.tolist(), y.tolist()) for a, b, x, y in want.pairs
        ]


@pytest.mark.parametrize(
    "s, d, repeats, error",
    [
        ([5, 6], [1, 1], None, "listed twice"),
        ([5, 6], [1, 1], -1, "listed twice"),  # the launcher could not tell: the arrays do
        ([5], [10**6], None, "outside"),
        ([10**6], [3], None, "outside"),
        ([5], [0], None, "null page"),
    ],
)
def test_checked_plan_refuses_what_direct_plan_refuses(s, d, repeats, error) -> None:
    table = PageTable.from_specs("m", specs(two_groups=True))
    pairs = {("full", "full"): _pair(s, d, repeats), ("extra", "extra"): _pair([], [])}
    with pytest.raises(MapperError, match=error):
        checked_direct_plan(table, table, pairs)


def test_checked_plan_wants_exactly_the_matched_pool_pairs() -> None:
    table = PageTable.from_specs("m", specs(two_groups=True))
    with pytest.raises(MapperError, match="matched"):
        checked_direct_plan(table, table, {("full", "full"): _pair([5], [1])})
    with pytest.raises(MapperError, match="matched"):
        checked_direct_plan(
            table, table, {("full", "extra"): _pair([5], [1]), ("extra", "full"): _pair([], [])}
        )


@pytest.mark.skipif(native_launch.toolchain_problem() is not None, reason="no C toolchain")
@pytest.mark.parametrize(
    "s, d",
    [
        ([5, 6, 7], [1, 2, 3]),
        ([5, 6, 255], [1, 2, 255]),  # the last page of each pool
        ([5, 6, 256], [1, 2, 3]),  # a source page past the pool
        ([5, 6, 7], [1, 2, 256]),  # a destination page past the pool
        ([5, 0, 7], [1, 2, 3]),  # a source null page: dropped
        ([5, 6, 7], [1, 0, 3]),  # the null page as a destination
        ([5, 6, -1], [1, 2, 3]),
        ([5, 6, 7], [4, 2, 4]),  # a destination page twice
        ([], []),
    ],
)
def test_launcher_stats_give_the_checks_direct_plan_gives(s: list[int], d: list[int]) -> None:
    """The C launcher's stats (kernels/csrc), through IdPair, accept and refuse exactly what
    direct_plan does, at the pools' edges."""
    mod = native_launch.module()
    assert mod is not None
    table = PageTable.from_specs("m", specs(two_groups=True))  # 256 pages a pool
    slot = np.zeros((2, 8), dtype=np.int64)
    n = mod.fill_ids(slot[0].ctypes.data, 8, s, 0)
    assert mod.fill_ids(slot[1].ctypes.data, 8, d, 0) == n == len(s)
    stats = mod.scan_ids(slot[0].ctypes.data, slot[1].ctypes.data, n)
    pair = IdPair(slot[0, :n], slot[1, :n], *stats[1:])
    empty = IdPair(slot[0, :0], slot[1, :0], 0, 0, 0, 0, 0)
    pairs = {("full", "full"): pair, ("extra", "extra"): empty}
    try:
        want = direct_plan(table, table, {"full": s, "extra": []}, {"full": d, "extra": []})
    except MapperError as e:
        with pytest.raises(MapperError) as got:
            checked_direct_plan(table, table, pairs)
        assert str(got.value) == str(e)
        return
    got = checked_direct_plan(table, table, pairs)
    assert got.total_bytes == want.total_bytes
    assert [(a, b, x.tolist(), y.tolist()) for a, b, x, y in got.pairs] == [
        (a, b, x.tolist(), y.tolist()) for a, b, x, y in want.pairs
    ]
