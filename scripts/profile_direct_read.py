"""Where the time of a direct read goes (transfer/direct_read.py), on the 2-GPU machine: P in a
spawned process on cuda:0 (scripts/transfer_bench_setup.py's prefill side), D here on cuda:1. Prints the
median of each phase (mapping, launch, lease check, wait for the copy, finish) per size, then a
cProfile of one pull of one size (--profile-mib).

    python scripts/profile_direct_read.py [--device cpu]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--profile-mib", type=int, default=16, help="the size cProfile watches")
    parser.add_argument("--progress-mode", default="auto")
    parser.add_argument("--back-to-back", action="store_true", help="see the loop below")
    parser.add_argument("--kernel-time", action="store_true", help="device time of the copies")
    parser.add_argument(
        "--spin-ms",
        type=float,
        default=0.0,
        help="busy-wait this long before each pull (a warm core, as in a busy decode worker)",
    )
    parser.add_argument(
        "--sleep-ms",
        type=float,
        default=0.0,
        help="sleep this long before each pull (the process's other threads finish their work)",
    )
    cli = parser.parse_args()
    args = probe_settings(cli.device, cli.sizes_mib, cli.progress_mode)
    spec = bench_spec(args.max_mib * MIB)
    host_probe = plan_cost_probe(spec)
    print(f"direct_plan of 64 pages, alone in the process: {host_probe():.1f} us", flush=True)
    conn, child, _ = start_prefill(args)
    device = torch.device("cuda:1" if cli.device == "cuda" else "cpu")
    buf = torch.zeros(spec.buffer_shape, dtype=spec.dtype, device=device)
    receiver = KVReceiver({"full": buf}, [spec], "bench", config(args))
    conn.send(receiver.runtime.worker_address)  # the child's raw-ucxx server wants it
    print(f"direct_plan of 64 pages, receiver up: {host_probe():.1f} us", flush=True)
    print(f"threads: {[t.name for t in threading.enumerate()]}", flush=True)

    phases: dict[str, list[float]] = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases.setdefault(name, []).append(time.perf_counter() - start)

        return wrapper

    if cli.device == "cuda":
        torch.cuda.set_device(1)  # D's GPU is the current one, as in a decode worker
    import transfer.direct_copy as dc
    from kernels.page_copy_triton import PreparedCopy

    dc.DirectCopier._take = timed("launch.take", dc.DirectCopier._take)
    dc.DirectCopier._queue = timed("launch.queue", dc.DirectCopier._queue)
    PreparedCopy.launch_ptrs = timed("launch.kernel", PreparedCopy.launch_ptrs)
    dr.DirectRead._map = timed("map", dr.DirectRead._map)
    dr.DirectRead._launch = timed("launch", dr.DirectRead._launch)
    dr.DirectRead._launch_native = timed("launch.native", dr.DirectRead._launch_native)
    dr.DirectRead._lease_problem = timed("lease", dr.DirectRead._lease_problem)
    dr.DirectRead._finish = timed("finish", dr.DirectRead._finish)
    dr.wait_copy_blocking = timed("wait", dr.wait_copy_blocking)
    # Inside the phases: the ticket checks and the plan (map), the digest (lease).
    dr.lease_digest = timed("lease.digest", dr.lease_digest)
    dr.source_pages = timed("map.source_pages", dr.source_pages)
    dr.direct_plan = timed("map.plan", dr.direct_plan)
    copier = receiver.direct_copier
    if copier is not None and copier._native is not None:  # the C launcher's own call
        copier._native = PatchedModule(
            copier._native, queue=timed("launch.c", copier._native.queue)
        )
    gen = torch.Generator().manual_seed(0)
    profile = cProfile.Profile()
    kernel_ms: list[float] = []
    if cli.kernel_time:  # device time of each copy kernel, from events around it on its stream
        from kernels.page_copy_triton import PreparedCopy

        plain = PreparedCopy.launch_ptrs
        pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

        def with_events(self, src_ids, dst_ids, n, stream):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s = torch.cuda.ExternalStream(stream)
            begin.record(s)
            plain(self, src_ids, dst_ids, n, stream)
            end.record(s)
            pending.append((begin, end))

        PreparedCopy.launch_ptrs = with_events
        if copier is not None and copier._native is not None:  # the C launcher's copies
            c_queue = copier._native.queue

            def queue_with_events(*args):
                # The begin event precedes the wait for D's model stream (idle here) and the kernel.
                begin = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                begin.record(copier.stream)
                out = c_queue(*args)
                end.record(copier.stream)
                pending.append((begin, end))
                return out

            copier._native.queue = queue_with_events
    for size in cli.sizes_mib:
        n = size * MIB // spec.page_bytes
        phases.clear()
        kernel_ms.clear()
        total = []
        c_steps: list[tuple[float, ...]] = []
        # Every ticket first, then the pulls back to back (--back-to-back: a warm core and GPU),
        # or one ticket at a time, each pull right after P's answer (as bench_transfer.py does).
        batch = cli.repeats + 1 if cli.back_to_back else 1
        rep = 0
        while rep < cli.repeats + 1:
            tickets = []
            for k in range(batch):
                src = choose_pages(n, spec, "scattered", gen)
                conn.send(("publish", f"p{size}-{rep + k}", src))
                tickets.append(conn.recv())
            for ticket in tickets:
                dst = choose_pages(n, spec, "scattered", gen)
                last = size == cli.profile_mib and rep == cli.repeats  # one pull: cProfile slows it
                if last:
                    profile.enable()
                if cli.sleep_ms:
                    time.sleep(cli.sleep_ms / 1e3)
                spin_until = time.perf_counter() + cli.spin_ms / 1e3
                while time.perf_counter() < spin_until:
                    pass
                start = time.perf_counter()
                result = receiver.pull_blocking(
                    ticket, {"full": dst}, 0, ticket.declared_prompt_len
                )
                total.append(time.perf_counter() - start)
                if last:
                    profile.disable()
                assert result.ok, result.error
                if copier is not None and copier._native is not None:
                    c_steps.append(copier._native.timings())
                if cli.kernel_time:
                    torch.cuda.synchronize(device)
                    kernel_ms.extend(b.elapsed_time(e) for b, e in pending)
                    pending.clear()
                rep += 1
        print(f"direct_plan of 64 pages, link up: {host_probe():.1f} us", flush=True)
        line = {k: round(statistics.median(v[1:]) * 1e3, 3) for k, v in phases.items()}
        if kernel_ms:
            line["kernel (device)"] = round(statistics.median(kernel_ms[1:]), 3)
        pull_ms = statistics.median(total[1:]) * 1e3
        print(
            f"{size:5d} MiB ({n} pages, {result.stats.path}): pull {pull_ms:.3f} ms, phases ms {line}"
        )
        if c_steps:
            steps = [round(statistics.median(x), 1) for x in zip(*c_steps[1:])]
            print(
                f"      C launcher in a pull, us (ids, context, model wait, launch, event): {steps}"
            )
            if not cli.kernel_time:  # (its copies would be counted as the next pulls')
                print(f"      the same launch, hot: {hot_launch(receiver, ticket, dst):.1f} us")
    # The same plan, hot: this pull's own tables and ids, back to back in this process.
    link = next(iter(receiver.links.open.values()))
    src_ids = {"full": np.asarray(ticket.page_ids["full"], dtype=np.int64)}
    dst_ids = {"full": np.asarray(dst, dtype=np.int64)}
    times = []
    for _ in range(200):
        start = time.perf_counter()
        dr.direct_plan(link.info.page_table, receiver.page_table, src_ids, dst_ids)
        times.append(time.perf_counter() - start)
    print(f"the last pull's direct_plan, hot: {statistics.median(times) * 1e6:.1f} us")
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(30)
    print(out.getvalue())
    receiver.close()
    child.terminate()  # a diagnostic: P's pages need no orderly release
    child.join(30)


def hot_launch(receiver, ticket, dst) -> float:
    """Host time of DirectCopier.start_pages for the last pull's pages, called back to back (each
    copy waited for outside the timing, so every call finds a free slot)."""
    copier = receiver.direct_copier
    link = next(iter(receiver.links.open.values()))
    times = []
    for _ in range(50):
        start = time.perf_counter()
        queued = copier.start_pages(
            link.access,
            link.info.page_table,
            receiver.page_table,
            ticket.page_ids,
            {"full": dst},
            0,
            receiver.rows,
        )
        times.append(time.perf_counter() - start)
        queued.event.synchronize()
        queued.release()
    return statistics.median(times[5:]) * 1e6


def plan_cost_probe(spec):
    """A timer of the plan of a 64-page pull (pure host work): compares this process's Python
    speed before and after the transceiver's threads start."""
    import numpy as np

    from transfer.page_table import PageTable
    from transfer.plan import direct_plan

    table = PageTable.from_specs("bench", [spec])
    rng = np.random.default_rng(0)
    src = {"full": rng.permutation(spec.num_pages - 1)[:64] + 1}
    dst = {"full": rng.permutation(spec.num_pages - 1)[:64] + 1}

    def probe() -> float:
        times = []
        for _ in range(200):
            start = time.perf_counter()
            direct_plan(table, table, src, dst)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6

    return probe


if __name__ == "__main__":
    main()
