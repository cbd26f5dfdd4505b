"""transfer/direct_copy.py on the CPU: how many ids a pinned slot holds. The copier itself needs a GPU
(test_direct_copy_gpu.py)."""

from __future__ import annotations

import torch

from transfer.direct_copy import MAX_SLOT_IDS, slot_capacity


def test_pinned_id_slots_hold_a_whole_pool_up_to_a_cap() -> None:
    small = {"full": torch.empty((300, 8)), "extra": torch.empty((41, 8))}
    assert slot_capacity(small) == 300 + 41 + 2  # one spare per pool for even offsets
    assert slot_capacity({"full": torch.empty((MAX_SLOT_IDS * 4, 1))}) == MAX_SLOT_IDS


def test_pools_that_widen_differently_are_copied_as_bytes() -> None:
    # P's pool 4 bytes off a word boundary, ours on one: a copy prepared with int64 rows on one
    # side and bytes on the other was refused, and every direct read from that peer failed.
    from transfer.direct_copy import _prepared

    buf = torch.zeros(8 * 4096 + 8, dtype=torch.uint8)
    p_rows = buf[4 : 4 + 8 * 4096].view(8, 4096)
    d_rows = torch.zeros(8, 4096, dtype=torch.uint8)
    copy = _prepared({}, "full", "full", {"full": p_rows}, {"full": d_rows})
    assert copy.src.dtype == copy.dst.dtype
