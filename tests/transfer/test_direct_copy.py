"""transfer/direct_copy.py on the CPU: how many ids a pinned slot holds. The copier itself needs a GPU
(test_direct_copy_gpu.py)."""

from __future__ import annotations

import torch

from transfer.direct_copy import MAX_SLOT_IDS, slot_capacity


def test_pinned_id_slots_hold_a_whole_pool_up_to_a_cap() -> None:
    small = {"full": torch.empty((300, 8)), "extra": torch.empty((41, 8))}
    assert slot_capacity(small) == 300 + 41 + 2  # one spare per pool for even offsets
    assert slot_capacity({"full": torch.empty((MAX_SLOT_IDS * 4, 1))}) == MAX_SLOT_IDS
