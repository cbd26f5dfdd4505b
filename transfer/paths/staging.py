"""Staging for the UCX path: chunks, the buffers they are gathered into or received into, and the
page copies between pools and buffers.

A pull's segments are cut into chunks of at most one staging buffer, at page boundaries: D plans
the cut and sends it (PullRequest.chunk_sizes), P cuts its own segments the same way and refuses
a plan that does not fit them or its buffers, so chunk ``i`` means the same pages on both sides. P
gathers a chunk's pages into a buffer (duet_kernels.gather_pages), UCX moves the buffer, D scatters it
into its pages (duet_kernels.scatter_pages). A chunk that is one stretch of a host pool on a side
skips that side's copy (``in_place``): UCX reads P's pages or writes D's itself. That is safe
because D waits for every receive into its pages before its pull returns (paths/ucx.py), so no
UCX write into D's pages outlives the pull, and P's lease holds its pages until every send ended
(or, on a link whose abort did not end them, until a chunk deadline after it: a late read of P's
pages goes to a pull that has already failed).

The copies block until the bytes are in place (on CUDA they wait for their side stream, which
orders itself after the model's): host copies run on the transceiver's loop itself, device ones
on its copy thread (UcxRuntime.copy).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

import duet_kernels
from transfer.mapper import Segment
from transfer.page_table import PageTable
from transfer.pools import as_words, page_slice, segment_ids


@dataclass(frozen=True)
class Chunk:
    index: int
    segments: tuple[Segment, ...]  # back to back in the buffer, in this order

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)


def plan_chunks(segments: Sequence[Segment], buffer_bytes: int) -> list[int]:
    """D's chunk plan for a pull: the bytes of each chunk, in order, whole pages each and cut only
    where a staging buffer (``buffer_bytes``) ends: a pull that fits one buffer goes in one
    message.

    (Smaller first and last chunks, so that gathers and scatters run under other chunks'
    transfers, did not pay on 2 cores: over TCP loopback the transfer itself keeps both cores
    busy, and a gather on the loop holds up P's notice that the previous send left, which the
    next one waits for. Same-run paired time, one chunk / pipelined: 16 MiB 0.96, 0.79 and 1.05
    [quartiles 0.85-1.20]; 64 MiB 1.00, 1.02 and 1.00, three runs of 15-21 repetitions at load
    3-8; docs/benchmarks/transfer.md.)"""
    sizes: list[int] = []
    filled = 0
    for seg in segments:
        if seg.nbytes_per_page > buffer_bytes:
            raise ValueError(
                f"a page of {seg.nbytes_per_page} bytes is larger than a staging buffer "
                f"({buffer_bytes})"
            )
        per_buffer = buffer_bytes // seg.nbytes_per_page  # pages of this segment a buffer holds
        pages = len(seg.src_ids)
        while pages:
            take = min(pages, (buffer_bytes - filled) // seg.nbytes_per_page)
            if take == 0:
                sizes.append(filled)
                filled = 0
                take = min(pages, per_buffer)
            filled += take * seg.nbytes_per_page
            pages -= take
    if filled:
        sizes.append(filled)
    return sizes


# Host pages at least this large go in one UCX message per run of pages consecutive on both sides,
# sent from P's pool and received into D's (``in_place``): no gather, no scatter. Same run, two
# pinned cores, scattered 720 KiB pages, alternated twice: a 16 MiB pull 6.05-6.29 ms in place
# against 7.56-8.99 ms staged, 64 MiB 24.0-24.9 against 31.3-36.1 ms (docs/benchmarks/transfer.md,
# "The bound on the UCX path"). Smaller pages would pay UCX's per-message cost (about 0.1 ms) for
# too few bytes: they stay staged.
RUN_PAGE_BYTES = 256 * 1024


def plan_runs(segments: Sequence[Segment], buffer_bytes: int) -> list[int]:
    """D's chunk plan for host pages of at least RUN_PAGE_BYTES: one chunk per run of pages whose
    ids are consecutive on both sides (at most a staging buffer's worth, so that P, which checks
    every plan against its buffers, takes it), so each chunk is one contiguous stretch of either
    pool."""
    sizes: list[int] = []
    for seg in segments:
        per_chunk = max(1, buffer_bytes // seg.nbytes_per_page)
        breaks = np.flatnonzero((np.diff(seg.src_ids) != 1) | (np.diff(seg.dst_ids) != 1)) + 1
        for run in np.split(np.arange(len(seg.src_ids)), breaks):
            for start in range(0, len(run), per_chunk):
                sizes.append(min(per_chunk, len(run) - start) * seg.nbytes_per_page)
    return sizes


def plan(segments: Sequence[Segment], buffer_bytes: int, device: torch.device) -> list[int]:
    """D's chunk plan: runs of host pages of at least RUN_PAGE_BYTES, which UCX moves in place;
    else staging buffers' worth."""
    runs = device.type == "cpu" and all(s.nbytes_per_page >= RUN_PAGE_BYTES for s in segments)
    return (plan_runs if runs else plan_chunks)(segments, buffer_bytes)


def in_place(chunk: Chunk, rows: Mapping[str, torch.Tensor], source: bool) -> torch.Tensor | None:
    """The chunk's bytes on one side (``source``: P's, else D's) as one contiguous view of that
    side's pool, when they are one: host memory, whole pages, consecutive ids. UCX then sends
    from the pool or receives into it, with no copy through a staging buffer. None otherwise.
    (Device pools are always staged: a copy there must be ordered after the model's stream,
    which a UCX write into the pool is not.)"""
    if len(chunk.segments) != 1:
        return None
    seg = chunk.segments[0]
    pool, ids, offset = (
        (seg.src_pool, seg.src_ids, seg.src_offset)
        if source
        else (seg.dst_pool, seg.dst_ids, seg.dst_offset)
    )
    pages = rows[pool]
    if pages.device.type != "cpu" or offset or seg.nbytes_per_page != pages.shape[1]:
        return None
    first = int(ids[0])
    if len(ids) > 1 and not (np.diff(ids) == 1).all():
        return None
    return pages[first : first + len(ids)].view(-1)


def cut_chunks(segments: Sequence[Segment], sizes: Sequence[int]) -> list[Chunk]:
    """The segments' pages, in order, cut into chunks of ``sizes`` bytes (a plan from
    ``plan_chunks``). Raises ValueError when the sizes do not fall on page boundaries or do not
    add up to the segments' bytes."""
    chunks: list[Chunk] = []
    current: list[Segment] = []
    want = list(sizes)
    room = want[0] if want else 0
    for seg in segments:
        start = 0
        while start < len(seg.src_ids):
            if room <= 0 or room % seg.nbytes_per_page and room < seg.nbytes_per_page:
                raise ValueError(
                    f"the chunk sizes {list(sizes)[:8]} do not fall on page boundaries"
                )
            take = min(len(seg.src_ids) - start, room // seg.nbytes_per_page)
            current.append(seg.part(start, start + take))
            start += take
            room -= take * seg.nbytes_per_page
            if room == 0:
                chunks.append(Chunk(len(chunks), tuple(current)))
                current = []
                room = want[len(chunks)] if len(chunks) < len(want) else 0
    if current or len(chunks) != len(want):
        raise ValueError(
            f"the chunk sizes {list(sizes)[:8]} (of {sum(sizes)} bytes) do not cut these "
            f"{sum(s.nbytes for s in segments)} bytes"
        )
    return chunks


def chunk_bytes_for(table: PageTable, staging_tokens: int) -> int:
    """Bytes of one staging buffer: ``staging_tokens`` tokens of every pool, in whole pages."""
    largest = max(p.tokens_per_page for p in table.pools)
    if staging_tokens < largest:
        raise ValueError(
            f"staging_tokens ({staging_tokens}) must hold at least one page ({largest} tokens)"
        )
    return sum(staging_tokens // p.tokens_per_page * p.page_bytes for p in table.pools)


def gather(chunk: Chunk, rows: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
    """Copy the chunk's source pages into ``out`` (uint8, at least ``chunk.nbytes``)."""
    with _on_side_stream(out.device):
        for seg, part in _parts(chunk, out):
            src = page_slice(rows[seg.src_pool], seg.src_offset, seg.nbytes_per_page)
            ids, _ = segment_ids(seg, out.device)
            src, part = as_words(src, part)
            duet_kernels.gather_pages(src, ids, part)


def scatter(chunk: Chunk, staged: torch.Tensor, rows: Mapping[str, torch.Tensor]) -> None:
    """Copy a received chunk from ``staged`` into its destination pages."""
    with _on_side_stream(staged.device):
        for seg, part in _parts(chunk, staged):
            dst = page_slice(rows[seg.dst_pool], seg.dst_offset, seg.nbytes_per_page)
            _, ids = segment_ids(seg, staged.device)
            part, dst = as_words(part, dst)
            duet_kernels.scatter_pages(part, dst, ids)


def _parts(chunk: Chunk, buf: torch.Tensor) -> list[tuple[Segment, torch.Tensor]]:
    """Each segment with its [pages, bytes per page] part of ``buf``."""
    out, offset = [], 0
    for seg in chunk.segments:
        n = len(seg.src_ids)
        out.append((seg, buf[offset : offset + seg.nbytes].view(n, seg.nbytes_per_page)))
        offset += seg.nbytes
    return out


class _on_side_stream:
    """On CUDA: run the copies on the staging stream after the model's stream, and wait for them."""

    streams: dict[torch.device, torch.cuda.Stream] = {}  # one per device, made on first use

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> None:
        if self.device.type == "cuda":
            stream = self.streams.get(self.device)
            if stream is None:
                stream = self.streams[self.device] = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.default_stream(self.device))
            self.stream, self.ctx = stream, torch.cuda.stream(stream)
            self.ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            self.ctx.__exit__(*exc)
            self.stream.synchronize()


class StagingBuffers:
    """``count`` buffers of ``nbytes`` each, allocated together on first use and shared by the
    pulls of one side. Loop thread only."""

    def __init__(self, device: torch.device, nbytes: int, count: int) -> None:
        self.device = device
        self.nbytes = nbytes
        self.count = count
        self._free: asyncio.Queue[torch.Tensor] = asyncio.Queue()
        self._made = 0
        self._block: torch.Tensor | None = None

    def try_acquire(self) -> torch.Tensor | None:
        if not self._free.empty():
            return self._free.get_nowait()
        if self._made == self.count:
            return None
        if self._block is None:
            # One allocation: UCX registers it once. Host memory is written now, so that no
            # chunk pays the first touch of its buffer.
            make = torch.empty if self.device.type == "cuda" else torch.zeros
            self._block = make(self.count * self.nbytes, dtype=torch.uint8, device=self.device)
        self._made += 1
        return self._block[(self._made - 1) * self.nbytes : self._made * self.nbytes]

    async def acquire(self) -> torch.Tensor:
        buf = self.try_acquire()
        return buf if buf is not None else await self._free.get()

    def release(self, buf: torch.Tensor) -> None:
        self._free.put_nowait(buf)
