"""Plain-torch reference twins of the transfer page kernels: whole-page gather, scatter and copy.

Pools are seen as 2-D views [num_pages, page_elems] (any dtype; the transceiver uses uint8 views), so
one page id selects one contiguous row of the page-major layout (kvcache/spec.py).
"""

from __future__ import annotations

import torch


def gather_pages_ref(src: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i] = src[page_ids[i]]; src [N, E], page_ids [n] int64, out [n, E]."""
    torch.index_select(src, 0, page_ids.to(src.device).long(), out=out)
    return out


def scatter_pages_ref(src: torch.Tensor, dst: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """dst[page_ids[i]] = src[i]; src [n, E], dst [N, E], page_ids [n] int64 (distinct)."""
    dst.index_copy_(0, page_ids.to(dst.device).long(), src)
    return dst


def copy_pages_ref(
    src: torch.Tensor,
    src_ids: torch.Tensor,
    dst: torch.Tensor,
    dst_ids: torch.Tensor,
    first_row: int = 0,
) -> torch.Tensor:
    """dst[dst_ids[i]] = src[src_ids[i]]; src [N, E], dst [M, E], ids [n] int64 (dst_ids distinct).
    A pair with either id outside [first_row, N) / [first_row, M) is skipped."""
    s, d = src_ids.to(src.device).long(), dst_ids.to(dst.device).long()
    keep = (s >= first_row) & (s < src.shape[0]) & (d.to(s.device) >= first_row)
    keep &= d.to(s.device) < dst.shape[0]
    rows = torch.index_select(src, 0, s[keep])
    dst.index_copy_(0, d[keep.to(d.device)], rows.to(dst.device))
    return dst
