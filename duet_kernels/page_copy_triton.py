"""Whole-page gather, scatter and page-to-page copy in Triton (the transceiver's page copies).

Pools are seen as 2-D views [num_pages, page_elems] (the transceiver passes uint8 views), one row
per page. A page can be megabytes (all layers of a group), so each row is split over many programs
of BLOCK elements each, and rows whose bytes allow it are reinterpreted as int32 so one thread moves
16-byte vectors with a quarter of the index arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from duet_kernels.checks import next_power_of_2

BLOCK_BYTES = 16384  # per program: 128 threads x 8 vectors of 16 bytes


@triton.jit
def _copy_rows_kernel(
    src_ptr,
    dst_ptr,
    ids_ptr,
    stride_src_row,
    stride_src_col,
    stride_dst_row,
    stride_dst_col,
    row_elems,
    blocks_per_row,
    INDEX_SRC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    i = pid // blocks_per_row
    offs = (pid % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
    page = tl.load(ids_ptr + i).to(tl.int64)
    if INDEX_SRC:  # gather: out[i] = src[page]
        src_row = page
        dst_row = i.to(tl.int64)
    else:  # scatter: dst[page] = src[i]
        src_row = i.to(tl.int64)
        dst_row = page
    ok = offs < row_elems
    x = tl.load(src_ptr + src_row * stride_src_row + offs * stride_src_col, mask=ok)
    tl.store(dst_ptr + dst_row * stride_dst_row + offs * stride_dst_col, x, mask=ok)


# The bounds are not specialized on: one compiled kernel serves pools of any size.
@triton.jit(do_not_specialize=["first_row", "src_rows", "dst_rows"])
def _copy_pairs_kernel(
    src_ptr,
    dst_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    stride_src_row,
    stride_dst_row,
    row_elems,
    blocks_per_row,
    first_row,
    src_rows,
    dst_rows,
    BLOCK: tl.constexpr,
):
    # Rows are contiguous here (copy_pages checks): unit column stride lets every thread move
    # 16-byte vectors, which is what keeps NVLink busy when dst is a peer GPU's pool.
    pid = tl.program_id(0)
    i = pid // blocks_per_row
    offs = (pid % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
    src_row = tl.load(src_ids_ptr + i).to(tl.int64)
    dst_row = tl.load(dst_ids_ptr + i).to(tl.int64)
    # A pair with an id outside [first_row, rows) is skipped: no access outside either pool, even
    # for ids nobody has checked.
    in_pools = (src_row >= first_row) & (src_row < src_rows)
    in_pools = in_pools & (dst_row >= first_row) & (dst_row < dst_rows)
    ok = offs < tl.where(in_pools, row_elems, 0)
    x = tl.load(src_ptr + src_row * stride_src_row + offs, mask=ok)
    tl.store(dst_ptr + dst_row * stride_dst_row + offs, x, mask=ok)


def _as_int32_rows(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as [rows, bytes / 4] int32 when layout and alignment allow, else t itself."""
    if t.dtype == torch.int32 or t.element_size() > 4 or t.dim() != 2 or t.stride(1) != 1:
        return t
    try:
        return t.view(torch.int32)
    except RuntimeError:  # row bytes, row stride or offset not a multiple of 4
        return t


def _tiling(
    src: torch.Tensor, dst: torch.Tensor, block_bytes: int
) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    """Word views of both sides (when both can be widened, else the originals), the row length in
    those words, the elements per program and the programs per row."""
    src_w, dst_w = _as_int32_rows(src), _as_int32_rows(dst)
    if src_w.dtype != dst_w.dtype:  # one side could not be widened: copy in the original dtype
        src_w, dst_w = src, dst
    row_elems = src_w.shape[1]
    block = min(next_power_of_2(row_elems), max(16, block_bytes // src_w.element_size()))
    return src_w, dst_w, row_elems, block, triton.cdiv(row_elems, block)


def _copy_rows(
    src: torch.Tensor, dst: torch.Tensor, page_ids: torch.Tensor, index_src: bool
) -> None:
    n = page_ids.shape[0]
    if n == 0 or src.shape[1] == 0:
        return
    src_w, dst_w, row_elems, block, blocks_per_row = _tiling(src, dst, BLOCK_BYTES)
    _copy_rows_kernel[(n * blocks_per_row,)](
        src_w,
        dst_w,
        page_ids,
        *src_w.stride(),
        *dst_w.stride(),
        row_elems,
        blocks_per_row,
        INDEX_SRC=index_src,
        BLOCK=block,
        num_warps=4,
    )


def _check_rows(a: torch.Tensor, b: torch.Tensor, what: str, shapes: str) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1] or a.dtype != b.dtype:
        raise ValueError(
            f"{what}: expected 2-D {shapes} tensors of one dtype, got {tuple(a.shape)} "
            f"{a.dtype} and {tuple(b.shape)} {b.dtype}"
        )


def _check(
    rows: torch.Tensor, pool: torch.Tensor, page_ids: torch.Tensor, what: str
) -> torch.Tensor:
    _check_rows(rows, pool, what, "[n, E] and [N, E]")
    if page_ids.dim() != 1 or page_ids.shape[0] != rows.shape[0]:
        raise ValueError(f"{what}: page_ids must be [{rows.shape[0]}], got {tuple(page_ids.shape)}")
    return page_ids.to(pool.device)


def gather_pages(src: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i] = src[page_ids[i]]; src [N, E], page_ids [n], out [n, E]. Returns out."""
    page_ids = _check(out, src, page_ids, "gather_pages")
    _copy_rows(src, out, page_ids, index_src=True)
    return out


def scatter_pages(src: torch.Tensor, dst: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """dst[page_ids[i]] = src[i]; src [n, E], dst [N, E], page_ids [n] (distinct). Returns dst."""
    page_ids = _check(src, dst, page_ids, "scatter_pages")
    _copy_rows(src, dst, page_ids, index_src=False)
    return dst


def copy_pages(
    src: torch.Tensor,
    src_ids: torch.Tensor,
    dst: torch.Tensor,
    dst_ids: torch.Tensor,
    block_bytes: int = BLOCK_BYTES,
    num_warps: int = 4,
    first_row: int = 0,
) -> torch.Tensor:
    """dst[dst_ids[i]] = src[src_ids[i]]; src [N, E], dst [M, E], ids [n] (dst_ids distinct).
    A pair with either id outside [first_row, N) / [first_row, M) is skipped. ``src`` or ``dst``
    may be another GPU's memory mapped into this process (CUDA IPC): one launch on the current
    device copies every page over NVLink. Returns dst."""
    if src_ids.dim() != 1 or src_ids.shape != dst_ids.shape:
        raise ValueError(
            f"copy_pages: src_ids and dst_ids must be 1-D of one length, got {tuple(src_ids.shape)} "
            f"and {tuple(dst_ids.shape)}"
        )
    _check_rows(src, dst, "copy_pages", "[N, E] and [M, E]")
    n = src_ids.shape[0]
    src_w, dst_w, row_elems, block, blocks_per_row = _tiling(src, dst, block_bytes)
    if src_w.stride(1) != 1 or dst_w.stride(1) != 1:
        raise ValueError("copy_pages: page rows must be contiguous")
    if n == 0 or row_elems == 0:
        return dst
    # The ids go to the GPU the kernel runs on (the current one), which reads them locally even
    # when src or dst is a peer GPU's memory.
    device = torch.device("cuda", torch.cuda.current_device()) if src.is_cuda else src.device
    _copy_pairs_kernel[(n * blocks_per_row,)](
        src_w,
        dst_w,
        src_ids.to(device),
        dst_ids.to(device),
        src_w.stride(0),
        dst_w.stride(0),
        row_elems,
        blocks_per_row,
        first_row,
        src_w.shape[0],
        dst_w.shape[0],
        BLOCK=block,
        num_warps=num_warps,
    )
    return dst
