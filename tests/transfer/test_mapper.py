"""The mapper: pools matched by role and window, one segment of page pairs per pool pair, pool groups of
different lengths, and mappings it cannot serve refused with the reason."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvcache.spec import PoolGroupSpec
from tests.transfer.conftest import MODEL, specs
from transfer.handshake import check_compatible
from transfer.mapper import MapperError, map_pages, match_pools, total_bytes
from transfer.page_table import PageTable

TABLE = PageTable.from_specs(MODEL, specs(two_groups=True))
PB = TABLE.pool("full").page_bytes


def renamed(table: PageTable, **names: str) -> PageTable:
    return dataclasses.replace(
        table,
        pools=tuple(dataclasses.replace(p, name=names.get(p.name, p.name)) for p in table.pools),
    )


def test_identity_pairs_pages_in_order_per_pool() -> None:
    (seg,) = map_pages(
        TABLE, TABLE, {"full": [3, 4, 9], "extra": []}, {"full": [7, 8, 2], "extra": []}
    )
    assert (seg.src_pool, seg.dst_pool) == ("full", "full")
    assert seg.src_ids.tolist() == [3, 4, 9] and seg.dst_ids.tolist() == [7, 8, 2]
    assert seg.src_ids.dtype == np.int64 and (seg.src_offset, seg.dst_offset) == (0, 0)
    assert seg.nbytes_per_page == PB and seg.nbytes == 3 * PB
    assert seg.part(1, 3).src_ids.tolist() == [4, 9]


def test_pool_groups_may_list_different_numbers_of_pages() -> None:
    """A sliding-window group holds only its window's pages: its list is shorter."""
    segs = map_pages(
        TABLE, TABLE, {"full": [1, 2, 3, 4], "extra": [5]}, {"full": [9, 8, 7, 6], "extra": [2]}
    )
    assert [(s.src_pool, len(s.src_ids)) for s in segs] == [("full", 4), ("extra", 1)]
    assert total_bytes(segs) == 4 * PB + TABLE.pool("extra").page_bytes


def test_pools_are_matched_by_role_not_by_name() -> None:
    dst = renamed(TABLE, full="attn", extra="other")
    assert match_pools(TABLE, dst) == {"full": "attn", "extra": "other"}
    segs = map_pages(TABLE, dst, {"full": [1], "extra": [2]}, {"attn": [5], "other": [6]})
    assert [(s.src_pool, s.dst_pool) for s in segs] == [("full", "attn"), ("extra", "other")]


def test_a_window_group_and_a_full_group_of_the_same_roles_are_told_apart_by_window() -> None:
    """A hybrid model's groups all hold keys and values (kvcache/spec.py's default roles)."""
    full = PoolGroupSpec("full", (5,), 32, 4, 2, 8, torch.float32)
    window = PoolGroupSpec("swa_8", (0, 1, 2, 3, 4), 32, 4, 2, 8, torch.float32, sliding_window=8)
    src = PageTable.from_specs(MODEL, [full, window])
    dst = renamed(PageTable.from_specs(MODEL, [window, full]), full="global", swa_8="local")
    assert match_pools(src, dst) == {"full": "global", "swa_8": "local"}
    assert check_compatible(src, src) == ""
    other = PageTable.from_specs(MODEL, [full, dataclasses.replace(window, sliding_window=16)])
    with pytest.raises(MapperError, match=r"'swa_8' \(roles \['key', 'value'\], a window of 8\)"):
        match_pools(src, other)


def test_null_source_pages_move_nothing() -> None:
    (seg,) = map_pages(
        TABLE, TABLE, {"full": [0, 0, 4, 5], "extra": []}, {"full": [8, 9, 10, 11], "extra": []}
    )
    assert seg.src_ids.tolist() == [4, 5] and seg.dst_ids.tolist() == [10, 11]


def test_head_sharded_pools_of_other_head_ranges_are_refused_for_now() -> None:
    hnd = dataclasses.replace(
        TABLE, pools=tuple(dataclasses.replace(p, mapper_kind="HND") for p in TABLE.pools)
    )
    half = dataclasses.replace(
        hnd,
        pools=tuple(
            dataclasses.replace(p, head_start=1, num_kv_heads=1, page_bytes=p.page_bytes // 2)
            for p in hnd.pools
        ),
    )
    with pytest.raises(
        MapperError, match=r"head ranges differ \(source 0\+2, destination 1\+1\); re-splitting"
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
                TABLE, pools=tuple(dataclasses.replace(p, mapper_kind="NHD") for p in TABLE.pools)
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
        (TABLE, {"full": [1, -1], "extra": []}, {"full": [1, 2], "extra": []}, "outside [0, 256)"),
        (TABLE, {"full": [1, 2], "extra": []}, {"full": [3, 3], "extra": []}, "listed twice"),
        (TABLE, {"full": [1], "extra": []}, {"full": [0], "extra": []}, "null page cannot receive"),
        (TABLE, {"full": [1]}, {"full": [1]}, "page ids name pools"),
        (TABLE, {"full": ["x"], "extra": []}, {"full": [1], "extra": []}, "not integers"),
    ],
)
def test_bad_mappings_are_refused(
    dst: PageTable, src_pages: dict, dst_pages: dict, reason: str
) -> None:
    with pytest.raises(MapperError) as err:
        map_pages(TABLE, dst, src_pages, dst_pages)
    assert reason in str(err.value)


def test_two_pools_of_the_same_roles_are_refused_in_the_handshake() -> None:
    twin = dataclasses.replace(TABLE.pool("full"), name="twin")
    two = dataclasses.replace(TABLE, pools=(*TABLE.pools, twin))
    with pytest.raises(MapperError, match="has no destination pool"):
        match_pools(two, TABLE)
    assert "cannot be mapped" in check_compatible(two, two)
    with pytest.raises(MapperError, match=r"destination pools \['extra'\] have no source pool"):
        match_pools(dataclasses.replace(TABLE, pools=TABLE.pools[:1]), TABLE)
