"""Probe: the CPU time of a pull next to raw ucxx's, thread by thread, in both processes.

On a host with few cores, TCP loopback is bound by the CPU: every byte is copied by the kernel on
both sides, so CPU time that a pull spends beyond raw ucxx's (Python, UCX's progress, unpacking a
piece list) comes out of the wire's speed. This runs the benchmark's prefill process
(scripts/transfer_bench_setup.py) and a decode-side receiver, as scripts/bench_transfer.py does,
and for each repetition times a pull of every layout and one raw ucxx exchange (order rotated),
reading each thread's on-CPU time (``se.sum_exec_runtime`` of /proc/PID/task/TID/sched, ns
resolution) before and ``--settle-ms`` after each (so work left after the caller's result, as P's
handling of the ack, counts too). Prints, per layout, the median wall time and the median CPU
milliseconds of each thread kind of D and P, raw ucxx's beside them.

    python scripts/probe_cpu_cost.py --size-mib 16 --pulls 30
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from transfer_baselines import raw_once, send_stop  # noqa: E402
from transfer_bench_setup import (  # noqa: E402
    LAYOUTS,
    choose_pages,
    cpu_decode_side,
    probe_settings,
    start_prefill,
)

MIB = 1 << 20
WARM_UP = 2


def thread_cpu_ms(pid: int, side: str, names: dict[int, str]) -> dict[str, float]:
    """On-CPU milliseconds of each of ``pid``'s threads so far, by ``side``, Python thread name
    (``names``: native id -> name; threads Python did not start are "native") and thread id."""
    out: dict[str, float] = {}
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/sched") as f:
                for line in f:
                    if line.startswith("se.sum_exec_runtime"):
                        name = names.get(int(tid), "native")[:16]
                        out[f"{side} {name} {tid}"] = float(line.split(":")[1])
                        break
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return out


def snapshot(pids: dict[str, int], names: dict[str, dict[int, str]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for side, pid in pids.items():
        out.update(thread_cpu_ms(pid, side, names[side]))
    return out


def d_thread_names() -> dict[int, str]:
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=16)
    parser.add_argument("--pulls", type=int, default=30)
    parser.add_argument(
        "--layouts", nargs="+", choices=LAYOUTS, default=["scattered", "contiguous"]
    )
    parser.add_argument("--settle-ms", type=float, default=20.0)
    args = parser.parse_args()
    settings = probe_settings("cpu", [args.size_mib])
    conn, child, child_address = start_prefill(settings)
    spec, receiver, raw_ep, raw_dst = cpu_decode_side(settings, args.size_mib, conn, child_address)
    runtime = receiver.runtime
    pids = {"D": os.getpid(), "P": child.pid}
    conn.send(("threads",))
    names = {"D": d_thread_names(), "P": conn.recv()}
    gen = torch.Generator().manual_seed(0)
    n = args.size_mib * MIB // spec.page_bytes
    cases = [*args.layouts, "raw"]
    wall: dict[str, list[float]] = defaultdict(list)
    cpu: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for rep in range(args.pulls):
        for case in cases[rep % len(cases) :] + cases[: rep % len(cases)]:
            if case != "raw":
                src = choose_pages(n, spec, case, gen, "p")
                dst = choose_pages(n, spec, case, gen, "d")
                conn.send(("publish", f"cpu-{rep}-{case}", src))
                ticket = conn.recv()
            before = snapshot(pids, names)
            start = time.perf_counter()
            if case == "raw":
                raw_once(runtime, raw_ep, raw_dst, args.size_mib * MIB)
            else:
                result = receiver.pull_blocking(
                    ticket, {"full": dst}, 0, ticket.declared_prompt_len
                )
                if not result.ok:
                    raise RuntimeError(result.error)
            elapsed = time.perf_counter() - start
            time.sleep(args.settle_ms / 1e3)
            after = snapshot(pids, names)
            if rep == WARM_UP - 1:  # threads started by the first pulls get their names
                names["D"] = d_thread_names()
                conn.send(("threads",))
                names["P"] = conn.recv()
            if rep >= WARM_UP:
                wall[case].append(elapsed)
                for name, ms in after.items():
                    cpu[case][name].append(ms - before.get(name, 0.0))
    runtime.run(send_stop(raw_ep), timeout=30)
    conn.send(("stop",))
    conn.recv()
    child.join(60)
    receiver.close()
    names = sorted({name for case in cases for name in cpu[case]})
    print(f"{args.size_mib} MiB, {len(wall['raw'])} repetitions, {os.cpu_count()} cores; medians")
    print(f"{'':32}" + "".join(f"{case:>12}" for case in cases))
    print(f"{'wall ms':32}" + "".join(f"{statistics.median(wall[c]) * 1e3:12.3f}" for c in cases))
    for name in names:
        row = [statistics.median(cpu[c][name]) if cpu[c][name] else 0.0 for c in cases]
        if max(row) >= 0.01:
            print(f"{name:32}" + "".join(f"{v:12.3f}" for v in row))
    totals = [
        statistics.median(
            sum(cpu[c][name][i] for name in names if cpu[c][name]) for i in range(len(wall[c]))
        )
        for c in cases
    ]
    print(f"{'all threads, cpu ms':32}" + "".join(f"{v:12.3f}" for v in totals))


if __name__ == "__main__":
    main()
