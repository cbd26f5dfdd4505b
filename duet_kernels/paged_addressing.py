"""Triton helpers shared by the paged attention kernels: where token `tok` of a sequence lives, and
the tanh of score soft-capping.

A sequence's token `tok` sits in page ``page_table[b, tok // page_size]`` at slot
``tok % page_size``. Offsets are computed in int64: a page-major pool of many GiB puts
``page * stride_page`` past 2**31 elements.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def token_page_and_slot(page_row_ptr, tok, mask, PAGE_SIZE: tl.constexpr):
    """Returns (page id as int64, slot within the page) for a vector of token positions.

    Masked-off tokens read page 0 (the null page), so callers may mask their cache loads with the
    same mask and never touch memory outside the pool.
    """
    page = tl.load(page_row_ptr + tok // PAGE_SIZE, mask=mask, other=0).to(tl.int64)
    return page, (tok % PAGE_SIZE).to(tl.int64)


@triton.jit
def soft_cap_tanh(x):
    """tanh(x) in float32 from the sigmoid (the same on every backend, the interpreter included)."""
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0
