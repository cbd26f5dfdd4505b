"""Where an awaited direct read loses against a blocking one (2-GPU machine; CPU works too).

P runs in a spawned process (scripts/transfer_bench_setup.py), D here. Every ticket is published
first; then, interleaved per repetition, one pull of each kind, back to back:
  blocking    ``pull_blocking`` on this thread
  awaited     ``loop.run_until_complete(pull(...))``: a decode worker's path (its loop awaits)
  in_loop     ``pull_blocking`` called from a coroutine on the same loop: the loop's own cost
and the loop's round trip alone (``run_until_complete`` of a coroutine that returns at once). The
medians print per size, with the awaited pull's time inside its coroutine.

    python scripts/probe_async_pull.py [--device cpu] [--sizes-mib 16 64 256]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transfer_bench_setup import (  # noqa: E402
    MIB,
    bench_spec,
    choose_pages,
    config,
    probe_settings,
    start_prefill,
)

from transfer import KVReceiver  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=15)
    cli = parser.parse_args()
    args = probe_settings(cli.device, cli.sizes_mib)
    spec = bench_spec(args.max_mib * MIB)
    conn, child, _ = start_prefill(args)
    device = torch.device("cuda:1" if cli.device == "cuda" else "cpu")
    if cli.device == "cuda":
        torch.cuda.set_device(device)
    buf = torch.zeros(spec.buffer_shape, dtype=spec.dtype, device=device)
    receiver = KVReceiver({"full": buf}, [spec], "bench", config(args))
    conn.send(receiver.runtime.worker_address)
    loop = asyncio.new_event_loop()
    gen = torch.Generator().manual_seed(0)

    async def noop() -> None:
        return None

    async def timed_inside(coro_fn, *a) -> tuple[float, object]:
        start = time.perf_counter()
        result = await coro_fn(*a)
        return time.perf_counter() - start, result

    async def blocking_in_loop(*a) -> object:
        return receiver.pull_blocking(*a)

    kinds = ("blocking", "awaited", "in_loop")
    for mib in cli.sizes_mib:
        n = mib * MIB // spec.page_bytes
        times: dict[str, list[float]] = {k: [] for k in (*kinds, "awaited_inside", "loop_alone")}
        tickets = {}
        for rep in range(cli.repeats + 1):
            for kind in kinds:
                conn.send(
                    ("publish", f"{kind}-{mib}-{rep}", choose_pages(n, spec, "scattered", gen))
                )
                tickets[kind, rep] = conn.recv()
        for rep in range(cli.repeats + 1):
            for kind in kinds:
                ticket = tickets[kind, rep]
                a = (
                    ticket,
                    {"full": choose_pages(n, spec, "scattered", gen)},
                    0,
                    n * spec.page_size,
                )
                start = time.perf_counter()
                if kind == "blocking":
                    result = receiver.pull_blocking(*a)
                elif kind == "awaited":
                    inside, result = loop.run_until_complete(timed_inside(receiver.pull, *a))
                else:
                    result = loop.run_until_complete(blocking_in_loop(*a))
                elapsed = time.perf_counter() - start
                assert result.ok, result.error
                if rep:
                    times[kind].append(elapsed)
                    if kind == "awaited":
                        times["awaited_inside"].append(inside)
            start = time.perf_counter()
            loop.run_until_complete(noop())
            if rep:
                times["loop_alone"].append(time.perf_counter() - start)
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        print(
            f"{mib:5d} MiB, median us: "
            + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
            + f" | awaited / blocking {med['blocking'] / med['awaited']:.2f}",
            flush=True,
        )
    receiver.close()
    child.terminate()  # a diagnostic: P's pages need no orderly release
    child.join(30)
    loop.close()


if __name__ == "__main__":
    main()
