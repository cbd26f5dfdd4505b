"""The baselines of scripts/bench_transfer.py, timed in the same run as the pulls: raw ucxx (a
request message, then one send of the same bytes back, between the same two processes) and, on two
GPUs, a torch peer copy GPU0 -> GPU1 on the copy engines; also what one staged chunk's gather and
scatter cost alone on the device."""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import torch

from transfer.mapper import Fragment
from transfer.plan import Chunk
from transfer.runtime import UcxRuntime
from transfer.staging import gather_chunk, pool_rows, scatter_chunk

REQ_TAG, DATA_TAG = 0x5EED0001, 0x5EED0002  # the raw exchange's request and data tags


def raw_once(runtime: UcxRuntime, ep: Any, dst: torch.Tensor, size: int) -> float:
    """A request message and one ucxx send of ``size`` bytes back, timed from the caller's thread
    like a pull."""

    async def go() -> None:
        out = dst[:size]
        recv = asyncio.ensure_future(
            runtime.ctx.recv(out.numpy() if out.device.type == "cpu" else out, tag=DATA_TAG)
        )
        await ep.send(torch.tensor([size], dtype=torch.int64).numpy(), tag=REQ_TAG, force_tag=True)
        await recv

    start = time.perf_counter()
    runtime.run(go(), timeout=120)
    return time.perf_counter() - start


async def send_stop(ep: Any) -> None:
    await ep.send(torch.zeros(1, dtype=torch.int64).numpy(), tag=REQ_TAG, force_tag=True)


def peer_buffers(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda:0")
    return src, torch.empty(size, dtype=torch.uint8, device="cuda:1")


def peer_copy_once(src: torch.Tensor, dst: torch.Tensor) -> float:
    """One torch peer copy GPU0 -> GPU1 (copy engines), from idle GPUs to both done."""
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    start = time.perf_counter()
    dst.copy_(src)
    torch.cuda.synchronize("cuda:1")
    torch.cuda.synchronize("cuda:0")
    return time.perf_counter() - start


def peer_copy_times(size: int, repeats: int) -> list[float]:
    """Peer copies back to back (the hot baseline; ``peer_copy_gap`` is the one timed after a
    round trip to P, like each pull)."""
    buffers = peer_buffers(size)
    return [peer_copy_once(*buffers) for _ in range(repeats + 1)][1:]


def host_copy_times(size: int, repeats: int) -> list[float]:
    """One copy of ``size`` bytes between two warm host buffers of this process, back to back: the
    memory's own speed, which a direct read of shared-memory pools (host_shm) compares with as a
    GPU pull compares with a peer copy."""
    src = torch.randint(0, 255, (size,), dtype=torch.uint8)
    dst = torch.zeros(size, dtype=torch.uint8)
    out = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        dst.copy_(src)
        out.append(time.perf_counter() - start)
    return out[1:]


def staging_copy_ms(buf: torch.Tensor, page_bytes: int, pages: list[int]) -> dict[str, float]:
    """Median time of gathering / scattering one chunk of ``pages`` of the pool ``buf``."""
    rows = pool_rows({"full": buf}, {"full": page_bytes})
    chunk = Chunk(
        0,
        tuple(Fragment("full", "full", p * page_bytes, p * page_bytes, page_bytes) for p in pages),
    )
    staged = torch.empty(chunk.nbytes, dtype=torch.uint8, device=buf.device)
    out = {}
    for name, fn, fn_args in [
        ("gather_ms", gather_chunk, (chunk, rows, staged)),
        ("scatter_ms", scatter_chunk, (chunk, staged, rows)),
    ]:
        times = []
        for _ in range(6):
            start = time.perf_counter()
            fn(*fn_args)
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times[1:]) * 1e3
    return out
