"""gather_pages_ref / scatter_pages_ref on uint8 page rows: exact copies, other rows untouched."""

from __future__ import annotations

import torch

from duet_kernels import copy_pages_ref, gather_pages_ref, scatter_pages_ref


def test_gather_ref_copies_the_listed_rows_in_order() -> None:
    pool = torch.arange(6 * 8, dtype=torch.uint8).view(6, 8)
    out = torch.full((3, 8), 255, dtype=torch.uint8)
    result = gather_pages_ref(pool, torch.tensor([4, 1, 5]), out)
    assert result is out
    assert out[:, 0].tolist() == [32, 8, 40]
    assert torch.equal(out, pool[[4, 1, 5]])


def test_scatter_ref_writes_only_the_listed_rows() -> None:
    dst = torch.zeros((6, 8), dtype=torch.uint8)
    rows = torch.arange(1, 17, dtype=torch.uint8).view(2, 8)
    result = scatter_pages_ref(rows, dst, torch.tensor([5, 2]))
    assert result is dst
    assert torch.equal(dst[5], rows[0]) and torch.equal(dst[2], rows[1])
    assert int(dst[[0, 1, 3, 4]].count_nonzero()) == 0


def test_copy_ref_moves_rows_between_pools_of_different_sizes() -> None:
    src = torch.arange(5 * 8, dtype=torch.uint8).view(5, 8)
    dst = torch.zeros((9, 8), dtype=torch.uint8)
    result = copy_pages_ref(src, torch.tensor([4, 1]), dst, torch.tensor([7, 2]))
    assert result is dst
    assert torch.equal(dst[7], src[4]) and torch.equal(dst[2], src[1])
    assert int(dst[[0, 1, 3, 4, 5, 6, 8]].count_nonzero()) == 0


def test_copy_ref_skips_pairs_outside_the_pools() -> None:
    src = torch.arange(1, 5 * 8 + 1, dtype=torch.uint8).view(5, 8)
    dst = torch.zeros((6, 8), dtype=torch.uint8)
    # Kept: 3->2. Skipped: a source past the pool, a destination past it, negative ids, and with
    # first_row=1 anything touching row 0.
    copy_pages_ref(
        src, torch.tensor([3, 5, 1, -1, 0, 2]), dst, torch.tensor([2, 1, 6, 3, 4, 0]), first_row=1
    )
    assert torch.equal(dst[2], src[3])
    assert int(dst[[0, 1, 3, 4, 5]].count_nonzero()) == 0


def test_copy_ref_of_page_sized_rows_goes_row_by_row_and_matches() -> None:
    """Rows of a page's size (>= ROW_BY_ROW_BYTES) are copied one by one, without the indexed
    copy's temporary: the same result, skipped pairs included."""
    from duet_kernels.page_copy_ref import ROW_BY_ROW_BYTES

    width = ROW_BY_ROW_BYTES // 8
    src = torch.randint(0, 1 << 40, (7, width), dtype=torch.int64)
    dst = torch.zeros((9, width), dtype=torch.int64)
    copy_pages_ref(src, torch.tensor([6, 2, 0, 9, 3]), dst, torch.tensor([1, 8, 4, 5, 9]), 1)
    assert torch.equal(dst[1], src[6]) and torch.equal(dst[8], src[2])
    assert int(dst[[0, 2, 3, 4, 5, 6, 7]].count_nonzero()) == 0
