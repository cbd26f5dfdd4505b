"""Probe: what cutting one transfer's bytes into several UCX tag messages costs, without any copy.

The staged UCX path sends a request's KV as one message per chunk (transfer/serve.py), raw ucxx as
one message. This moves the same bytes between two processes through the transceiver's UCX runtime
(same endpoints and settings as scripts/bench_transfer.py on the CPU: TCP loopback, peer error
handling, a sleeping progress thread): D posts every receive, asks with a small request message,
and P sends the bytes as N equal messages with at most K of them in flight. Prints the median wall
time of each cut and its ratio to one message, interleaved per repetition.
Usage: python scripts/probe_ucx_messages.py [--sizes-mib 16 64] [--repeats 10] [--cuts 8x8 64x64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from probe_pair import connect_back, start_pair  # noqa: E402

MIB = 1 << 20
REQ_TAG, DATA_TAG = 1 << 60, 1 << 50
CUTS = [(2, 1), (2, 2), (4, 1), (4, 4), (8, 1), (8, 2), (8, 8)]  # (messages, in flight)


async def send_part(ep: Any, src: np.ndarray, part: int, i: int, slots: asyncio.Semaphore) -> None:
    async with slots:
        await ep.send(src[i * part : (i + 1) * part], tag=DATA_TAG + i, force_tag=True)


def sender_main(conn: Any, max_bytes: int) -> None:
    runtime, ep = connect_back(conn)
    src = np.random.default_rng(0).integers(0, 255, max_bytes, dtype=np.uint8)

    async def serve() -> None:
        header = np.zeros(3, dtype=np.int64)
        while True:
            await runtime.ctx.recv(header, tag=REQ_TAG)
            total, n, in_flight = header.tolist()
            if total == 0:
                return
            part, slots = total // n, asyncio.Semaphore(in_flight)
            await asyncio.gather(*(send_part(ep, src, part, i, slots) for i in range(n)))

    runtime.run(serve(), timeout=3600)
    conn.send("done")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--cuts",
        nargs="+",
        default=[f"{n}x{k}" for n, k in CUTS],
        help="cuts to time as MESSAGESxIN_FLIGHT, e.g. 64x64 (a message per 256 KiB page of 16 MiB)",
    )
    args = parser.parse_args()
    cuts = [tuple(int(v) for v in c.split("x")) for c in args.cuts]
    max_bytes = max(args.sizes_mib) * MIB
    runtime, ep, conn, child = start_pair(sender_main, max_bytes)
    dst = np.zeros(max_bytes, dtype=np.uint8)

    async def once(total: int, n: int, in_flight: int) -> None:
        part = total // n
        receives = [
            asyncio.ensure_future(
                runtime.ctx.recv(dst[i * part : (i + 1) * part], tag=DATA_TAG + i)
            )
            for i in range(n)
        ]
        request = np.array([total, n, in_flight], dtype=np.int64)
        await ep.send(request, tag=REQ_TAG, force_tag=True)
        await asyncio.gather(*receives)

    for size in args.sizes_mib:
        times: dict[tuple[int, ...], list[float]] = {c: [] for c in [(1, 1), *cuts]}
        for rep in range(args.repeats + 1):  # interleaved, after one warm-up repetition
            for cut in times:
                start = time.perf_counter()
                runtime.run(once(size * MIB, *cut), timeout=120)
                if rep:
                    times[cut].append(time.perf_counter() - start)
        one = statistics.median(times[(1, 1)])
        cells = [
            f"{n} in flight {k}: {statistics.median(times[n, k]) * 1e3:.1f} ms "
            f"({one / statistics.median(times[n, k]):.2f})"
            for n, k in cuts
        ]
        print(
            f"{size} MiB: one message {one * 1e3:.1f} ms ({size * MIB / one / 1e9:.2f} GB/s); "
            + "; ".join(cells),
            flush=True,
        )
    runtime.run(ep.send(np.zeros(3, dtype=np.int64), tag=REQ_TAG, force_tag=True), timeout=30)
    conn.recv()
    child.join(30)
    runtime.release()


if __name__ == "__main__":
    main()
