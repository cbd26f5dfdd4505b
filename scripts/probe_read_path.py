"""Where a direct read's time goes below the transceiver, on 2 GPUs of one process: the host cost of
each launch step (the old path's id upload, stream switches and Triton dispatch against
transfer/direct_copy.py's), and the device time of the copy kernel reading GPU 0's pages from
GPU 1, next to a peer copy of the same bytes.

    python scripts/probe_read_path.py [--sizes-mib 16 64 256 1024] [--host-only] > probe.log

Device times are taken between two events with the launch queued behind a spin (torch.cuda._sleep),
so they hold no host cost; host costs are medians of many back-to-back calls (hot caches, no other
thread: a lower bound for a pull). An earlier version of this script (commit fc9982f) also swept
program sizes, warps, cache modifiers and a persistent grid: all within 0.02 of each other
(docs/benchmarks/probe_read_path_gpu.log).
"""

# ruff: noqa: B023  (each closure is timed inside the iteration that made it)
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transfer_bench_setup import bench_spec  # noqa: E402

from kernels.page_copy_triton import PreparedCopy  # noqa: E402
from transfer.direct_copy import DirectCopier  # noqa: E402
from transfer.lease_board import lease_digest  # noqa: E402
from transfer.page_table import PageTable  # noqa: E402
from transfer.plan import DirectPlan, direct_plan  # noqa: E402

MIB = 1 << 20
PAGE = 256 * 1024


def device_ms(fn, repeats: int, dev: int) -> float:
    """Median device time of ``fn``'s work on ``dev``'s current stream, host cost excluded."""
    out = []
    with torch.cuda.device(dev):
        for rep in range(repeats + 1):
            torch.cuda.synchronize(dev)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(2_000_000)  # ~1 ms of spin: the launches below queue behind it
            a.record()
            fn()
            b.record()
            b.synchronize()
            if rep:
                out.append(a.elapsed_time(b))
    return statistics.median(out)


def host_us(fn, repeats: int = 200) -> float:
    fn()
    out = []
    for _ in range(repeats):
        s = time.perf_counter()
        fn()
        out.append(time.perf_counter() - s)
    return statistics.median(out) * 1e6


def host_costs(a: torch.Tensor, b: torch.Tensor, s_np: np.ndarray, d_np: np.ndarray) -> None:
    """The launch steps of one 64-page read, old path (upload, context managers, dispatch) and
    new (DirectCopier: pinned ids, one ordering event, the compiled kernel called directly)."""
    dev1 = b.device
    side = torch.cuda.Stream(device=dev1)
    ids_dev = torch.from_numpy(np.stack([s_np, d_np])).to(dev1)
    copy = PreparedCopy(a, b, first_row=1)

    def stream_ctx() -> None:
        with torch.cuda.stream(side):
            pass

    src, dst = {"full": a.view(torch.uint8)}, {"full": b.view(torch.uint8)}
    copier = DirectCopier(dev1, capacity=4096)
    copies: dict = {}
    plan = DirectPlan((("full", "full", s_np, d_np),), len(s_np) * PAGE)

    def copier_start() -> float:
        t0 = time.perf_counter()
        queued = copier.start(plan, copies, src, dst)
        t1 = time.perf_counter()
        queued.event.synchronize()  # (untimed) so that the next start finds its slot free
        queued.release()
        return t1 - t0

    copier_start()  # compiles
    pinned = torch.zeros((2, 64), dtype=torch.int64, pin_memory=True)
    pinned[0], pinned[1] = torch.from_numpy(s_np), torch.from_numpy(d_np)
    ptrs = pinned[0].data_ptr(), pinned[1].data_ptr()
    prepared = copies[("full", "full")]
    table = PageTable.from_specs("bench", [bench_spec(b.shape[0] * PAGE)])
    pages = {"full": s_np}
    costs = {
        "pageable upload (.to(dev))": lambda: torch.from_numpy(np.stack([s_np, d_np])).to(dev1),
        "with torch.cuda.stream": stream_ctx,
        "stream.wait_stream(default)": lambda: side.wait_stream(torch.cuda.default_stream(dev1)),
        "Triton dispatch launch (device ids)": lambda: copy.launch(ids_dev[0], ids_dev[1], 64),
        "PreparedCopy.launch_ptrs (pinned ids)": lambda: prepared.launch_ptrs(
            *ptrs, 64, side.cuda_stream
        ),
        "direct_plan (64 pages)": lambda: direct_plan(table, table, pages, {"full": d_np}),
        "lease_digest (64 pages)": lambda: lease_digest("req", pages),
    }
    for name, fn in costs.items():
        print(f"host {name:40s} {host_us(fn):8.1f} us", flush=True)
    median = statistics.median(copier_start() for _ in range(200))
    print(f"host {'DirectCopier.start (64 pages)':40s} {median * 1e6:8.1f} us", flush=True)
    torch.cuda.synchronize(dev1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--host-only", action="store_true", help="skip the device times")
    args = parser.parse_args()
    pages = max(args.sizes_mib) * MIB // PAGE + 64
    a = torch.randint(-(2**62), 2**62, (pages, PAGE // 8), dtype=torch.int64, device="cuda:0")
    b = torch.zeros((pages, PAGE // 8), dtype=torch.int64, device="cuda:1")
    # Peer access both ways, as opening an IPC pool gives, through scratch tensors.
    x, y = torch.zeros(1, device="cuda:0"), torch.zeros(1, device="cuda:1")
    y.copy_(x)
    x.copy_(y)
    rng = np.random.default_rng(0)
    torch.cuda.set_device(1)  # D's GPU, as in a decode worker
    s_np = rng.permutation(pages - 1)[:64].astype(np.int64) + 1
    d_np = rng.permutation(pages - 1)[:64].astype(np.int64) + 1
    host_costs(a, b, s_np, d_np)
    if args.host_only:
        return
    read, push = PreparedCopy(a, b, first_row=1), PreparedCopy(a, b, first_row=1)
    for size in args.sizes_mib:
        n = size * MIB // PAGE
        flat_a, flat_b = a.view(-1)[: size * MIB // 8], b.view(-1)[: size * MIB // 8]
        s_host = torch.from_numpy(rng.permutation(pages - 1)[:n] + 1).pin_memory()
        d_host = torch.from_numpy(rng.permutation(pages - 1)[:n] + 1).pin_memory()
        on = {dev: (s_host.to(f"cuda:{dev}"), d_host.to(f"cuda:{dev}")) for dev in (0, 1)}
        row = {
            "peer copy (copy engines)": device_ms(lambda: flat_b.copy_(flat_a), args.repeats, 1),
            "read kernel, ids on GPU 1": device_ms(lambda: read.launch(*on[1], n), args.repeats, 1),
            "read kernel, ids in pinned host memory": device_ms(
                lambda: read.launch(s_host, d_host, n), args.repeats, 1
            ),
            # What the old kernels.copy_pages did: ids on the source GPU, read across NVLink.
            "read kernel, ids on GPU 0": device_ms(lambda: read.launch(*on[0], n), args.repeats, 1),
            "push kernel (on GPU 0), ids on GPU 0": device_ms(
                lambda: push.launch(*on[0], n), args.repeats, 0
            ),
        }
        got = b[on[1][1][:4]].cpu()
        assert torch.equal(got, a[on[0][0][:4]].cpu()), "the copy is wrong"
        base = row["peer copy (copy engines)"]
        print(f"== {size} MiB ({n} pages): device ms, GB/s, peer copy / variant", flush=True)
        for k, v in row.items():
            print(f"   {k:40s} {v:8.4f} ms  {size * MIB / v / 1e6:7.1f} GB/s  {base / v:5.2f}")


if __name__ == "__main__":
    main()
