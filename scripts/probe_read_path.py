"""Where a direct read's time goes below the transceiver, on 2 GPUs of one process: the host cost of
each launch step (id upload, streams, events, the Triton launch), and the device time of copy-kernel
variants reading GPU 0's pages from GPU 1, next to a peer copy of the same bytes.

    python scripts/probe_read_path.py [--sizes-mib 16 64 256 1024] > probe.log

Device times are taken between two events with the launch queued behind a spin (torch.cuda._sleep),
so they hold no host cost; host costs are medians of many back-to-back calls.
"""

# ruff: noqa: B023  (each closure is timed inside the iteration that made it)
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels.page_copy_triton import copy_pages  # noqa: E402

MIB = 1 << 20
PAGE = 256 * 1024


@triton.jit
def _variant_kernel(
    src_ptr,
    dst_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    stride_src_row,
    stride_dst_row,
    blocks_per_row,
    BLOCK: tl.constexpr,
    LOAD_CACHE: tl.constexpr,
    STORE_CACHE: tl.constexpr,
):
    pid = tl.program_id(0)
    i = pid // blocks_per_row
    offs = (pid % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(src_ids_ptr + i).to(tl.int64)
    d = tl.load(dst_ids_ptr + i).to(tl.int64)
    x = tl.load(src_ptr + s * stride_src_row + offs, cache_modifier=LOAD_CACHE)
    tl.store(dst_ptr + d * stride_dst_row + offs, x, cache_modifier=STORE_CACHE)


@triton.jit
def _persistent_kernel(
    src_ptr,
    dst_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    stride_src_row,
    stride_dst_row,
    blocks_per_row,
    total_blocks,
    BLOCK: tl.constexpr,
):
    # Two blocks in flight per program: both loads issued before either store.
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    for b in range(pid, total_blocks, 2 * step):
        b2 = b + step
        i = b // blocks_per_row
        offs = (b % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
        s = tl.load(src_ids_ptr + i).to(tl.int64)
        d = tl.load(dst_ids_ptr + i).to(tl.int64)
        x = tl.load(src_ptr + s * stride_src_row + offs)
        ok2 = b2 < total_blocks
        i2 = tl.where(ok2, b2 // blocks_per_row, 0)
        offs2 = (b2 % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
        s2 = tl.load(src_ids_ptr + i2).to(tl.int64)
        d2 = tl.load(dst_ids_ptr + i2).to(tl.int64)
        y = tl.load(src_ptr + s2 * stride_src_row + offs2, mask=(offs2 >= 0) & ok2)
        tl.store(dst_ptr + d * stride_dst_row + offs, x)
        tl.store(dst_ptr + d2 * stride_dst_row + offs2, y, mask=(offs2 >= 0) & ok2)


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


def copier_costs(a: torch.Tensor, b: torch.Tensor, s_np: np.ndarray, d_np: np.ndarray) -> None:
    """Host time of the direct path's pieces, called back to back (hot caches, no other thread):
    what a pull would cost if nothing else ran in its process."""
    from transfer.direct_copy import DirectCopier
    from transfer.lease_board import lease_digest
    from transfer.page_table import PageTable, PoolDescriptor
    from transfer.plan import DirectPlan, direct_plan

    dev1 = b.device
    src, dst = {"full": a.view(torch.uint8)}, {"full": b.view(torch.uint8)}
    copier = DirectCopier(dev1, capacity=4096)
    copies: dict = {}
    plan = DirectPlan((("full", "full", s_np, d_np),), len(s_np) * PAGE)

    def start_and_wait() -> float:
        t0 = time.perf_counter()
        queued = copier.start(plan, copies, src, dst)
        t1 = time.perf_counter()
        queued.event.synchronize()
        queued.release()
        return t1 - t0

    start_and_wait()  # compiles
    print(
        f"host DirectCopier.start (64 pages)         {statistics.median(start_and_wait() for _ in range(200)) * 1e6:8.1f} us"
    )
    copy = copies[("full", "full")]
    pinned = torch.zeros((2, 64), dtype=torch.int64, pin_memory=True)
    pinned[0], pinned[1] = torch.from_numpy(s_np), torch.from_numpy(d_np)
    handle = copier.stream.cuda_stream
    ptrs = pinned[0].data_ptr(), pinned[1].data_ptr()
    print(
        f"host PreparedCopy.launch_ptrs              {host_us(lambda: copy.launch_ptrs(*ptrs, 64, handle)):8.1f} us"
    )
    mark = torch.cuda.Event()
    model = torch.cuda.default_stream(dev1)

    def order() -> None:
        mark.record(model)
        copier.stream.wait_event(mark)

    print(f"host mark.record + wait_event              {host_us(order):8.1f} us")
    torch.cuda.synchronize(dev1)
    spec = PoolDescriptor(
        "full",
        ("full",),
        "identity",
        tuple(range(32)),
        16,
        2,
        64,
        "bfloat16",
        PAGE,
        b.shape[0],
        "NHD",
    )
    table = PageTable("bench", (spec,))
    pages = {"full": s_np}
    print(
        f"host direct_plan (64 pages)                {host_us(lambda: direct_plan(table, table, pages, {'full': d_np})):8.1f} us"
    )
    print(
        f"host lease_digest (64 pages)               {host_us(lambda: lease_digest('req', pages)):8.1f} us"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--host-only", action="store_true", help="skip the device-time variants")
    args = parser.parse_args()
    pages = max(args.sizes_mib) * MIB // PAGE + 64
    a = torch.randint(-(2**31), 2**31 - 1, (pages, PAGE // 4), dtype=torch.int32, device="cuda:0")
    b = torch.zeros((pages, PAGE // 4), dtype=torch.int32, device="cuda:1")
    b.view(-1)[:1].copy_(a.view(-1)[:1])  # peer access both ways, as opening an IPC pool does
    a.view(-1)[:1].copy_(b.view(-1)[:1])
    sms = torch.cuda.get_device_properties(1).multi_processor_count
    rng = np.random.default_rng(0)
    dev1 = torch.device("cuda:1")
    torch.cuda.set_device(1)

    # ---- host costs of the launch steps (64 scattered pages), on D's device ----
    s_np = rng.permutation(pages - 1)[:64].astype(np.int64) + 1
    d_np = rng.permutation(pages - 1)[:64].astype(np.int64) + 1
    side = torch.cuda.Stream(device=dev1)
    ids_dev = torch.from_numpy(np.stack([s_np, d_np])).to(dev1)
    pinned = torch.empty((2, 4096), dtype=torch.int64, pin_memory=True)
    ev = torch.cuda.Event()
    kernel_args = dict(BLOCK=4096, LOAD_CACHE="", STORE_CACHE="")

    def launch_variant(ids=ids_dev, n=64, grid_blocks=16, **kw):
        _variant_kernel[(n * grid_blocks,)](
            a, b, ids[0], ids[1], a.stride(0), b.stride(0), grid_blocks, **kw
        )

    def pinned_fill():
        pinned[0, :64].copy_(torch.from_numpy(s_np))
        pinned[1, :64].copy_(torch.from_numpy(d_np))

    def pinned_fill_np():
        pn = pinned.numpy()
        pn[0, :64] = s_np
        pn[1, :64] = d_np

    def stream_ctx():
        with torch.cuda.stream(side):
            pass

    def device_ctx():
        with torch.cuda.device(dev1):
            pass

    costs = {
        "np.stack+from_numpy": lambda: torch.from_numpy(np.stack([s_np, d_np])),
        "pageable upload (.to(dev))": lambda: torch.from_numpy(np.stack([s_np, d_np])).to(dev1),
        "pinned fill (torch copy_)": pinned_fill,
        "pinned fill (numpy)": pinned_fill_np,
        "pinned upload non_blocking": lambda: pinned[:, :64].to(dev1, non_blocking=True),
        "with torch.cuda.stream": stream_ctx,
        "with torch.cuda.device": device_ctx,
        "stream.wait_stream(default)": lambda: side.wait_stream(torch.cuda.default_stream(dev1)),
        "Event() + record": lambda: torch.cuda.Event().record(side),
        "event.record (reused)": lambda: ev.record(side),
        "event.query": lambda: ev.query(),
        "record_stream": lambda: ids_dev.record_stream(side),
        "kernels copy_pages (uint8 rows)": lambda: copy_pages(
            a.view(torch.uint8), ids_dev[0], b.view(torch.uint8), ids_dev[1]
        ),
        "triton launch, device ids": lambda: launch_variant(**kernel_args),
        "triton launch, pinned host ids": lambda: launch_variant(ids=pinned, **kernel_args),
    }
    for name, fn in costs.items():
        try:
            print(f"host {name:38s} {host_us(fn):8.1f} us", flush=True)
        except Exception as e:  # a variant this stack refuses
            print(f"host {name:38s} failed: {type(e).__name__}: {e}", flush=True)
    torch.cuda.synchronize(1)
    copier_costs(a, b, s_np, d_np)
    if args.host_only:
        return

    # ---- device time of copy variants, GPU 1 reading GPU 0 ----
    for size in args.sizes_mib:
        n = size * MIB // PAGE
        flat_a, flat_b = a.view(-1)[: size * MIB // 4], b.view(-1)[: size * MIB // 4]
        s_ids = torch.from_numpy(rng.permutation(pages - 1)[:n] + 1).to(dev1)
        d_ids = torch.from_numpy(rng.permutation(pages - 1)[:n] + 1).to(dev1)
        s_host = s_ids.cpu().pin_memory()
        d_host = d_ids.cpu().pin_memory()
        row = {"peer_copy_ce": device_ms(lambda: flat_b.copy_(flat_a), args.repeats, 1)}
        row["peer_copy_ce_push"] = device_ms(lambda: flat_b.copy_(flat_a), args.repeats, 0)
        row["current_copy_pages"] = device_ms(
            lambda: copy_pages(a.view(torch.uint8), s_ids, b.view(torch.uint8), d_ids),
            args.repeats,
            1,
        )
        for block in (1024, 4096, 8192):
            for warps in (4, 8):
                for lc, sc in (("", ""), (".cg", ""), (".cv", ".cs")):
                    name = f"read_b{block * 4 // 1024}k_w{warps}{lc or '_'}{sc or '_'}"

                    def run(block=block, warps=warps, lc=lc, sc=sc):
                        bpr = PAGE // 4 // block
                        _variant_kernel[(n * bpr,)](
                            a,
                            b,
                            s_ids,
                            d_ids,
                            a.stride(0),
                            b.stride(0),
                            bpr,
                            BLOCK=block,
                            LOAD_CACHE=lc,
                            STORE_CACHE=sc,
                            num_warps=warps,
                        )

                    row[name] = device_ms(run, args.repeats, 1)
        bpr = PAGE // 4 // 4096

        def run_pinned():
            _variant_kernel[(n * bpr,)](
                a,
                b,
                s_host,
                d_host,
                a.stride(0),
                b.stride(0),
                bpr,
                BLOCK=4096,
                LOAD_CACHE="",
                STORE_CACHE="",
                num_warps=4,
            )

        try:
            row["read_pinned_host_ids"] = device_ms(run_pinned, args.repeats, 1)
            assert torch.equal(b[d_ids[:4]].cpu(), a[s_ids[:4].to("cuda:0")].cpu())
        except Exception as e:
            print(f"pinned ids failed: {type(e).__name__}: {e}")
        for occ in (2, 4, 8):
            for block in (2048, 4096):
                bpr = PAGE // 4 // block

                def run_persist(occ=occ, block=block, bpr=bpr):
                    grid = min(n * bpr, sms * occ)
                    _persistent_kernel[(grid,)](
                        a,
                        b,
                        s_ids,
                        d_ids,
                        a.stride(0),
                        b.stride(0),
                        bpr,
                        n * bpr,
                        BLOCK=block,
                        num_warps=4,
                    )

                row[f"persist_occ{occ}_b{block * 4 // 1024}k"] = device_ms(
                    run_persist, args.repeats, 1
                )
        # Push for reference: the same kernel launched on GPU 0 writing GPU 1.
        s0, d0 = s_ids.to("cuda:0"), d_ids.to("cuda:0")
        row["push_current"] = device_ms(
            lambda: copy_pages(a.view(torch.uint8), s0, b.view(torch.uint8), d0), args.repeats, 0
        )
        assert torch.equal(b[d_ids[:4]].cpu(), a[s_ids[:4].to("cuda:0")].cpu())
        base = row["peer_copy_ce"]
        print(f"== {size} MiB ({n} pages): device ms, and peer copy / variant", flush=True)
        for k, v in sorted(row.items(), key=lambda kv: kv[1]):
            print(f"   {k:34s} {v:8.4f} ms  {size * MIB / v / 1e6:7.1f} GB/s  {base / v:5.2f}")


if __name__ == "__main__":
    main()
