"""Staging: buffers a chunk is gathered into (P) or received into (D), and the page copies.

A pool's storage is seen as uint8 rows [num_pages, page_bytes] (kvcache/spec.py: a page is one
contiguous run), so a chunk's fragments are gathered (torch index_select on word rows, the kernels
package's reference twin) into one contiguous buffer, sent as one UCX message, and scattered
(index_copy_) on the other side. A
side whose pages of a chunk are one run (Chunk.src_run, Chunk.dst_run) skips its copy:
``pool_region`` is the pool's own memory for it.

The copy functions block until the bytes are in place (on CUDA they synchronize their stream), since
UCX reads and writes the buffers as soon as it is handed them. They run on the transceiver's copy
thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import numpy as np
import torch

from kernels.page_copy_ref import gather_pages_ref, scatter_pages_ref
from transfer.plan import Chunk


def pool_rows(
    buffers: Mapping[str, torch.Tensor], page_bytes: Mapping[str, int]
) -> dict[str, torch.Tensor]:
    """uint8 views [num_pages, page_bytes] of each pool's storage (which must be contiguous)."""
    rows = {}
    for name, buf in buffers.items():
        if not buf.is_contiguous():
            raise ValueError(f"pool {name!r}: the storage tensor must be contiguous")
        flat = buf.view(-1).view(torch.uint8)
        rows[name] = flat.view(-1, page_bytes[name])
    return rows


def pool_region(rows: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """The pool's own bytes [offset, offset + nbytes) as a contiguous 1-D uint8 view."""
    return rows.view(-1)[offset : offset + nbytes]


def gather_chunk(chunk: Chunk, src_rows: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
    """Copy the chunk's source pages into ``out`` (uint8, at least chunk.nbytes), in fragment order."""
    with _copy_stream(out):
        for pool, offset, ids, nbytes in _page_groups(chunk, src_rows, source=True):
            rows = src_rows[pool]
            staged = out[offset : offset + nbytes].view(len(ids), rows.shape[1])
            rows, staged = as_words(rows, staged)
            gather_pages_ref(rows, ids, staged)


def scatter_chunk(chunk: Chunk, staged: torch.Tensor, dst_rows: Mapping[str, torch.Tensor]) -> None:
    """Copy a received chunk from ``staged`` into its destination pages."""
    with _copy_stream(staged):
        for pool, offset, ids, nbytes in _page_groups(chunk, dst_rows, source=False):
            rows = dst_rows[pool]
            part = staged[offset : offset + nbytes].view(len(ids), rows.shape[1])
            part, rows = as_words(part, rows)
            scatter_pages_ref(part, rows, ids)


def word_rows(rows: torch.Tensor) -> torch.Tensor:
    """The same bytes as int64 rows when the row size and address allow: torch's copy of uint8
    rows goes through a byte loop that is many times slower (and on CPU collapses on a busy host),
    while int64 rows are copied in words. On GPUs torch's index_select on word rows and
    kernels.gather_pages' Triton kernel measured the same (0.155 ms for 256 MiB of 256 KiB pages on
    an H200, docs/benchmarks/transfer.md)."""
    if rows.shape[1] % 8 or rows.data_ptr() % 8:
        return rows
    return rows.view(torch.int64)


def as_words(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both as word rows when both can be, else both as byte rows (a copy across dtypes would
    convert values)."""
    wa, wb = word_rows(a), word_rows(b)
    return (wa, wb) if wa.dtype == wb.dtype else (a, b)


def _page_groups(chunk: Chunk, rows: Mapping[str, torch.Tensor], source: bool):
    """(pool, byte offset in the chunk, page ids, bytes) for each run of fragments of one pool, so a
    chunk costs one kernel launch per pool rather than one per fragment."""
    groups: list[list] = []  # [pool, byte offset, page ids, bytes]
    offset = 0
    for frag in chunk.fragments:
        pool = frag.src_pool if source else frag.dst_pool
        page_bytes = rows[pool].shape[1]
        first = (frag.src_offset if source else frag.dst_offset) // page_bytes
        pages = range(first, first + frag.nbytes // page_bytes)
        if groups and groups[-1][0] == pool:
            # Extended in place: a chunk of single-page fragments stays linear in its pages (a
            # new list per fragment cost 3.5 ms per 256 MiB chunk, docs/benchmarks/transfer.md).
            groups[-1][2].extend(pages)
            groups[-1][3] += frag.nbytes
        else:
            groups.append([pool, offset, list(pages), frag.nbytes])
        offset += frag.nbytes
    for pool, start, ids, nbytes in groups:
        device = rows[pool].device
        if device.type == "cuda":
            # Pinned, copied on the copy stream: no synchronous pageable upload per chunk. The host
            # tensor outlives the copy (the caller synchronizes the stream before returning).
            host = torch.from_numpy(np.array(ids, dtype=np.int64)).pin_memory()
            yield pool, start, host.to(device, non_blocking=True), nbytes
        else:
            yield pool, start, torch.from_numpy(np.array(ids, dtype=np.int64)), nbytes


_side_streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}


def side_stream(device: torch.device, name: str) -> torch.cuda.Stream:
    """The transceiver's stream ``name`` on ``device`` (made once): page copies run off the
    model's stream, and the staging copies and the direct copies (direct_copy.py) each on their own."""
    stream = _side_streams.get((device, name))
    if stream is None:
        stream = _side_streams[(device, name)] = torch.cuda.Stream(device)
    return stream


class _copy_stream:
    """On CUDA: run the copies on the staging side stream and wait for them; on CPU: nothing."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.device = tensor.device
        self.ctx = None

    def __enter__(self) -> None:
        if self.device.type == "cuda":
            stream = side_stream(self.device, "staging")
            # Pages may have been written on the default stream (the model's): order after it.
            stream.wait_stream(torch.cuda.default_stream(self.device))
            self.stream = stream
            self.ctx = torch.cuda.device(self.device)
            self.ctx.__enter__()
            self.stream_ctx = torch.cuda.stream(stream)
            self.stream_ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.ctx is not None:
            self.stream_ctx.__exit__(*exc)
            self.stream.synchronize()
            self.ctx.__exit__(*exc)


class StagingBuffers:
    """``max_buffers`` buffers of ``buffer_bytes`` each, allocated on first use and shared by all
    transfers of one side. ``acquire`` waits (the caller bounds it) while all are in use. Used from
    the event loop thread only."""

    def __init__(self, device: torch.device, buffer_bytes: int, max_buffers: int) -> None:
        if max_buffers < 1:
            raise ValueError(f"need at least one staging buffer, got {max_buffers}")
        self.device = device
        self.buffer_bytes = buffer_bytes
        self.max_buffers = max_buffers
        self._free: asyncio.Queue[torch.Tensor] = asyncio.Queue()
        self._made = 0
        self._block: torch.Tensor | None = None

    def try_acquire(self) -> torch.Tensor | None:
        if not self._free.empty():
            return self._free.get_nowait()
        if self._made < self.max_buffers:
            if self._block is None:
                # One allocation for all buffers: UCX registers (and a GPU peer maps) it once. Host
                # memory is written once now: with never-written staging memory a staged 1 MiB pull
                # took 4.7-6.3 ms on a 32-core host, against 2.6 ms with it written (its UCX
                # message alone 2.0-3.3 ms against 1.1 ms; not explained, measured in
                # docs/benchmarks/transfer.md, tenth pass).
                make = torch.empty if self.device.type == "cuda" else torch.zeros
                self._block = make(
                    self.max_buffers * self.buffer_bytes, dtype=torch.uint8, device=self.device
                )
            self._made += 1
            return self._block[
                (self._made - 1) * self.buffer_bytes : self._made * self.buffer_bytes
            ]
        return None

    async def acquire(self) -> torch.Tensor:
        buf = self.try_acquire()
        return buf if buf is not None else await self._free.get()

    def release(self, buf: torch.Tensor) -> None:
        self._free.put_nowait(buf)

    @property
    def in_use(self) -> int:
        return self._made - self._free.qsize()
