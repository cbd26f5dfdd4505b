"""Timeline of one direct read as the caller sees it, with as little instrumentation as possible:
one perf_counter_ns stamp at each step boundary (the caller's call, the C launch before and after,
the checks, the wait for the copy, the finish, the caller's return), medians over many pulls, in
microseconds from the caller's call. Pulls either right after P's answer on the pipe (``gap``: an
idle GPU and a caller that just woke up, as the benchmark's default runs) or back to back
(``hot``: every ticket published first). P runs on cuda:0 in a spawned process
(scripts/transfer_bench_setup.py), D here on cuda:1.

    python scripts/probe_cold_pull.py [--sizes-mib 16 64] [--repeats 25]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transfer_bench_setup import (  # noqa: E402
    MIB,
    PatchedModule,
    bench_spec,
    choose_pages,
    config,
    probe_settings,
    start_prefill,
)

import transfer.direct_read as dr  # noqa: E402
from transfer import KVReceiver  # noqa: E402
from transfer.direct_copy import DirectCopier  # noqa: E402

STAMPS: list[tuple[str, int]] = []


def stamp(name: str) -> None:
    STAMPS.append((name, time.perf_counter_ns()))


def stamped(fn: Any, name: str) -> Any:
    """``fn`` with a stamp "<name>>" before and "<name><" after each call."""

    def wrapper(*a: Any, **k: Any) -> Any:
        stamp(f"{name}>")
        try:
            return fn(*a, **k)
        finally:
            stamp(f"{name}<")

    return wrapper


def around(owner: Any, attr: str, name: str) -> None:
    setattr(owner, attr, stamped(getattr(owner, attr), name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--repeats", type=int, default=25)
    cli = parser.parse_args()
    cuda = torch.cuda.device_count() > 1  # (else host pools: a check of this script on a CPU)
    args = probe_settings("cuda" if cuda else "cpu", cli.sizes_mib)
    spec = bench_spec(args.max_mib * MIB)
    conn, child, _ = start_prefill(args)
    if cuda:
        torch.cuda.set_device(1)  # D's GPU is the current one, as in a decode worker
    buf = torch.zeros(spec.buffer_shape, dtype=spec.dtype, device="cuda:1" if cuda else "cpu")
    receiver = KVReceiver({"full": buf}, [spec], "bench", config(args))
    conn.send(receiver.runtime.worker_address)
    around(DirectCopier, "start_pages", "start_pages")
    around(dr.DirectRead, "_checks", "checks")
    around(dr, "wait_copy_blocking", "wait")
    around(dr.DirectRead, "_finish", "finish")
    copier = receiver.direct_copier
    if copier is not None and copier._native is not None:
        copier._native = PatchedModule(copier._native, queue=stamped(copier._native.queue, "C"))
    gen = torch.Generator().manual_seed(0)

    def publish(n: int, name: str) -> Any:
        conn.send(("publish", name, choose_pages(n, spec, "scattered", gen)))
        return conn.recv()

    def pull(ticket: Any, n: int) -> list[tuple[str, int]]:
        dst = choose_pages(n, spec, "scattered", gen)
        STAMPS.clear()
        stamp("call")
        result = receiver.pull_blocking(ticket, {"full": dst}, 0, ticket.declared_prompt_len)
        stamp("return")
        if not result.ok or result.stats.path == "ucx":
            raise RuntimeError(f"pull failed or not direct: {result.error} {result.stats.path}")
        return list(STAMPS)

    pull(publish(16, "first"), 16)  # the link, the route, the kernel
    for size in cli.sizes_mib:
        n = size * MIB // spec.page_bytes
        runs: dict[str, list[list[tuple[str, int]]]] = {"gap": [], "hot": []}
        for rep in range(cli.repeats + 1):
            runs["gap"].append(pull(publish(n, f"gap-{size}-{rep}"), n))
        tickets = [publish(n, f"hot-{size}-{rep}") for rep in range(cli.repeats + 1)]
        runs["hot"] = [pull(t, n) for t in tickets]
        for mode, stamps in runs.items():
            marks: dict[str, list[float]] = {}
            for one in stamps[1:]:
                t0 = one[0][1]
                for name, t in one:
                    marks.setdefault(name, []).append((t - t0) / 1e3)
            line = " | ".join(f"{k} {statistics.median(v):6.1f}" for k, v in marks.items())
            print(f"{size:5d} MiB {mode}: {line}", flush=True)
    receiver.close()
    child.terminate()  # (its raw ucxx server would wait for a stop message)
    child.join(30)


if __name__ == "__main__":
    main()
