"""The baselines of scripts/bench_transfer.py, timed in the same run as the pulls: raw ucxx (a
request message, then one send of the same bytes back, between the same two processes) and, on two
GPUs, a torch peer copy GPU0 -> GPU1 on the copy engines."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from transfer.runtime import UcxRuntime

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
