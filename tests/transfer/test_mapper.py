"""The mapper: pools matched by role, identity runs merged, unsupported mappings refused."""

from __future__ import annotations

import dataclasses
import random

import pytest

from tests.transfer.conftest import MODEL, specs
from transfer.mapper import SMALL_RUNS, Fragment, MapperError, map_pages, match_pools
from transfer.page_table import PageTable
from transfer.peer import check_compatible

TABLE = PageTable.from_specs(MODEL, specs(two_groups=True))
PB = TABLE.pool("full").page_bytes


def renamed(table: PageTable, **names: str) -> PageTable:
    return dataclasses.replace(
        table,
        pools=tuple(dataclasses.replace(p, name=names.get(p.name, p.name)) for p in table.pools),
    )


def test_identity_merges_runs_consecutive_on_both_sides() -> None:
    frags = map_pages(
        TABLE,
        TABLE,
        {"full": [3, 4, 5, 9, 10, 20], "extra": []},
        {"full": [7, 8, 2, 11, 12, 13], "extra": []},
    )
    assert frags == [
        Fragment("full", "full", 3 * PB, 7 * PB, 2 * PB),
        Fragment("full", "full", 5 * PB, 2 * PB, PB),
        Fragment("full", "full", 9 * PB, 11 * PB, 2 * PB),
        Fragment("full", "full", 20 * PB, 13 * PB, PB),
    ]


def naive_runs(src: list[int], dst: list[int]) -> list[Fragment]:
    """The identity mapping page by page: each page extends the run before it if both of its ids
    follow that run's."""
    out: list[Fragment] = []
    for s, d in zip(src, dst):
        last = out[-1] if out else None
        if (
            last
            and s * PB == last.src_offset + last.nbytes
            and d * PB == last.dst_offset + last.nbytes
        ):
            out[-1] = last._replace(nbytes=last.nbytes + PB)
        else:
            out.append(Fragment("full", "full", s * PB, d * PB, PB))
    return out


@pytest.mark.parametrize("count", [1, SMALL_RUNS, SMALL_RUNS + 1, 200])
@pytest.mark.parametrize("seed", range(4))
def test_runs_short_and_long_lists_match_the_page_by_page_mapping(count: int, seed: int) -> None:
    # (long lists take the numpy path: runs of both kinds, single pages and a run on one side only)
    rng = random.Random(seed)
    ids = rng.sample(range(1, 256), 255)
    src, dst = ids[:count], sorted(ids)[:count] if seed % 2 else ids[-count:]
    frags = map_pages(TABLE, TABLE, {"full": src, "extra": []}, {"full": dst, "extra": []})
    assert frags == naive_runs(src, dst)
    assert all(type(f) is Fragment for f in frags)


def test_pools_are_matched_by_role_not_by_name() -> None:
    dst = renamed(TABLE, full="attn", extra="other")
    assert match_pools(TABLE, dst) == {"full": "attn", "extra": "other"}
    frags = map_pages(TABLE, dst, {"full": [1], "extra": [2]}, {"attn": [5], "other": [6]})
    assert [(f.src_pool, f.dst_pool) for f in frags] == [("full", "attn"), ("extra", "other")]


def test_null_source_pages_move_nothing() -> None:
    frags = map_pages(
        TABLE, TABLE, {"full": [0, 0, 4, 5], "extra": []}, {"full": [8, 9, 10, 11], "extra": []}
    )
    assert frags == [Fragment("full", "full", 4 * PB, 10 * PB, 2 * PB)]


def test_head_sharded_pools_with_other_head_counts_are_refused() -> None:
    hnd = dataclasses.replace(
        TABLE, pools=tuple(dataclasses.replace(p, mapper_kind="HND") for p in TABLE.pools)
    )
    half = dataclasses.replace(
        hnd,
        pools=tuple(
            dataclasses.replace(p, num_kv_heads=1, page_bytes=p.page_bytes // 2) for p in hnd.pools
        ),
    )
    with pytest.raises(
        MapperError, match=r"\(HND\): head counts differ \(source 2, destination 1\); re-splitting"
    ):
        map_pages(hnd, half, {"full": [1], "extra": [1]}, {"full": [1], "extra": [1]})


@pytest.mark.parametrize(
    "dst, src_pages, dst_pages, reason",
    [
        (
            dataclasses.replace(TABLE, pools=TABLE.pools[:1]),
            {"full": [1]},
            {"full": [1]},
            "has no destination pool",
        ),
        (
            dataclasses.replace(
                TABLE, pools=tuple(dataclasses.replace(p, mapper_kind="HND") for p in TABLE.pools)
            ),
            {"full": [1], "extra": []},
            {"full": [1], "extra": []},
            "mapper kinds differ",
        ),
        (
            TABLE,
            {"full": [1, 2], "extra": []},
            {"full": [1], "extra": []},
            "2 source pages but 1 destination",
        ),
        (TABLE, {"full": [1, 256], "extra": []}, {"full": [1, 2], "extra": []}, "outside [0, 256)"),
        (TABLE, {"full": [1, 2], "extra": []}, {"full": [3, 3], "extra": []}, "listed twice"),
        (TABLE, {"full": [1], "extra": []}, {"full": [0], "extra": []}, "null page cannot receive"),
        (TABLE, {"full": [1]}, {"full": [1]}, "source page ids name pools"),
    ],
)
def test_bad_mappings_are_refused(
    dst: PageTable, src_pages: dict, dst_pages: dict, reason: str
) -> None:
    with pytest.raises(MapperError) as err:
        map_pages(TABLE, dst, src_pages, dst_pages)
    assert reason in str(err.value)


def test_two_source_pools_never_fill_the_same_destination_pool() -> None:
    twin = dataclasses.replace(TABLE.pool("full"), name="twin")
    two = dataclasses.replace(TABLE, pools=(*TABLE.pools, twin))  # two pools of the same roles
    with pytest.raises(MapperError, match="source has two pools with roles"):
        match_pools(two, TABLE)
    assert "cannot be mapped" in check_compatible(two, two)  # refused in the handshake
    with pytest.raises(MapperError, match=r"destination pools \['extra'\] have no source pool"):
        match_pools(dataclasses.replace(TABLE, pools=TABLE.pools[:1]), TABLE)
