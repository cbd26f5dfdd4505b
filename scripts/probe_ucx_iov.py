"""Probe: scattered pages as one UCX message with an IOV datatype, against one contiguous message.

Moves N pages of 256 KiB between two processes through the transceiver's UCX runtime (the CPU
benchmark's settings: TCP loopback, peer error handling, a sleeping progress thread). P's pages and
D's pages are random permutations of their pools. Cases, interleaved per repetition, each
repetition starting with the next case:
  contig   one ucxx message from contiguous bytes into contiguous bytes (raw ucxx)
  both IOV one message, P's pages as an IOV list, received into D's pages as an IOV list
  only D / only P IOV   one side lists scattered pages, the other moves contiguous bytes
Prints medians and checks the bytes of the last IOV run.
Usage: python scripts/probe_ucx_iov.py [--sizes-mib 16 64] [--repeats 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from probe_pair import connect_back, start_pair  # noqa: E402

MIB, PAGE = 1 << 20, 256 << 10
REQ_TAG, DATA_TAG = 1 << 60, 1 << 50
# Which side lists scattered pages (IOV) and which moves contiguous bytes.
MODES = {0: "contiguous", 2: "only D IOV", 3: "only P IOV", 1: "both IOV"}


def pages_of(pool: np.ndarray, order: np.ndarray, n: int) -> list[tuple[int, int]]:
    base = pool.ctypes.data
    return [(base + int(p) * PAGE, PAGE) for p in order[:n]]


def sender_main(conn: Any, max_bytes: int) -> None:
    runtime, ep = connect_back(conn)
    iov = runtime.iov
    n_pool = max_bytes // PAGE
    pool = np.random.default_rng(0).integers(0, 255, max_bytes, dtype=np.uint8)
    order = np.random.default_rng(1).permutation(n_pool)

    async def serve() -> None:
        header = np.zeros(2, dtype=np.int64)
        while True:
            await runtime.ctx.recv(header, tag=REQ_TAG)
            total, mode = header.tolist()
            if total == 0:
                return
            if mode in (0, 2):
                await ep.send(pool[:total], tag=DATA_TAG, force_tag=True)
            else:
                await iov.send(
                    ep.ucp_endpoint, pages_of(pool, order, total // PAGE), DATA_TAG, set()
                )

    runtime.run(serve(), timeout=3600)
    conn.send(pool.reshape(-1, PAGE)[order].tobytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    max_bytes = max(args.sizes_mib) * MIB
    runtime, ep, conn, child = start_pair(sender_main, max_bytes)
    iov = runtime.iov
    dst = np.zeros(max_bytes, dtype=np.uint8)
    order = np.random.default_rng(2).permutation(max_bytes // PAGE)

    async def once(total: int, mode: int) -> None:
        if mode in (0, 3):
            receive = runtime.ctx.recv(dst[:total], tag=DATA_TAG)
        else:
            receive = iov.recv(pages_of(dst, order, total // PAGE), DATA_TAG, set())
        import asyncio

        task = asyncio.ensure_future(receive)
        await ep.send(np.array([total, mode], dtype=np.int64), tag=REQ_TAG, force_tag=True)
        await task

    for size in args.sizes_mib:
        times: dict[int, list[float]] = {m: [] for m in MODES}
        modes = list(times)
        for rep in range(args.repeats + 1):
            # Each repetition starts with another case (a case that always ran last could be
            # slower or faster for its place alone); the checked run comes after the loop.
            for mode in modes[rep % 4 :] + modes[: rep % 4]:
                start = time.perf_counter()
                runtime.run(once(size * MIB, mode), timeout=120)
                if rep:
                    times[mode].append(time.perf_counter() - start)
        runtime.run(once(size * MIB, 1), timeout=120)  # both IOV last: its bytes are checked
        raw = statistics.median(times[0])
        rest = "; ".join(
            f"{MODES[m]} {statistics.median(times[m]) * 1e3:.1f} ms "
            f"({raw / statistics.median(times[m]):.2f})"
            for m in MODES
            if m
        )
        print(
            f"{size} MiB: one contiguous message {raw * 1e3:.1f} ms ({size * MIB / raw / 1e9:.2f} "
            f"GB/s); {rest}",
            flush=True,
        )
    last = args.sizes_mib[-1] * MIB // PAGE
    runtime.run(ep.send(np.zeros(2, dtype=np.int64), tag=REQ_TAG, force_tag=True), timeout=30)
    sent = np.frombuffer(conn.recv(), dtype=np.uint8)
    got = dst.reshape(-1, PAGE)[order[:last]].reshape(-1)
    print("bytes exact:", bool(np.array_equal(got, sent[: last * PAGE])), flush=True)
    child.join(30)
    runtime.release()


if __name__ == "__main__":
    main()
