"""A worker's pools as page rows: the views every data path copies pages between.

A pool's storage is seen as uint8 rows ``[num_pages, page_bytes]`` (kvcache/spec.py: a page is one
contiguous run). The copies read and write the same bytes as int64 rows where the page size and
address allow: torch copies uint8 rows byte by byte on the CPU, and int64 rows in words.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from transfer.mapper import Segment


def pool_rows(
    buffers: Mapping[str, torch.Tensor], page_bytes: Mapping[str, int]
) -> dict[str, torch.Tensor]:
    """uint8 views [num_pages, page_bytes] of each pool's storage (which must be contiguous)."""
    rows = {}
    for name, buf in buffers.items():
        if not buf.is_contiguous():
            raise ValueError(f"pool {name!r}: the storage tensor must be contiguous")
        rows[name] = buf.view(-1).view(torch.uint8).view(-1, page_bytes[name])
    return rows


def as_words(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two uint8 row views as int64 rows when the size, strides and addresses of both allow,
    else both as they are."""
    if all(_wordable(t) for t in (a, b)):
        return a.view(torch.int64), b.view(torch.int64)
    return a, b


def _wordable(rows: torch.Tensor) -> bool:
    return (
        rows.dtype == torch.uint8
        and rows.stride(1) == 1
        and rows.shape[1] % 8 == 0
        and rows.stride(0) % 8 == 0
        and rows.data_ptr() % 8 == 0
    )


def page_slice(rows: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """The bytes ``[offset, offset + nbytes)`` of every page (all of it in the identity mapping)."""
    return rows if (offset, nbytes) == (0, rows.shape[1]) else rows[:, offset : offset + nbytes]


def segment_ids(segment: Segment, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The segment's page ids as int64 tensors on ``device``.

    To a GPU they go in one asynchronous copy from pinned memory on the current stream (the
    copy's side stream), which orders them before the kernel that reads them. A plain ``.to``
    from numpy's pageable memory is a synchronous copy: the calling thread (D's event loop) waits
    for the stream, which waits for the model stream's queued work, once per id list. Torch's
    pinned-memory cache keeps the buffer until the copy has run."""
    ids = np.stack([segment.src_ids, segment.dst_ids]).astype(np.int64, copy=False)
    both = torch.from_numpy(ids)
    if device.type == "cuda":
        both = both.pin_memory().to(device, non_blocking=True)
    return both[0], both[1]
