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
    s, d = s[keep], d[keep.to(d.device)]
    if src.device == dst.device and src.shape[1] * src.element_size() >= ROW_BY_ROW_BYTES:
        # Row by row: an indexed copy goes through a temporary as large as the copy, whose
        # fresh pages cost more than the copy itself (several times, for tens of MiB).
        for si, di in zip(s.tolist(), d.tolist(), strict=True):
            dst[di].copy_(src[si])
        return dst
    rows = torch.index_select(src, 0, s)
    dst.index_copy_(0, d, rows.to(dst.device))
    return dst


ROW_BY_ROW_BYTES = 64 << 10  # rows at least this long are copied one by one (a page usually is)
