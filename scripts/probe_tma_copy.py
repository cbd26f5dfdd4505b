"""Experiment: does a Hopper TMA copy (Triton tensor descriptors) read a peer GPU's scattered pages
faster than the direct path's plain load/store kernel? Device time only, on 2 GPUs of one process:
GPU 1 reads GPU 0's scattered 256 KiB pages, next to a copy-engine peer copy of the same bytes.

    python scripts/probe_tma_copy.py [--sizes-mib 16 64 256 1024] > probe_tma.log

Each variant is timed between two events, queued behind a spin (as scripts/probe_read_path.py
does), median of --repeats; a variant that fails to compile prints its error and the rest go on.
"""

# ruff: noqa: B023  (each closure is timed inside the iteration that made it)
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from probe_read_path import device_ms as device_ms_on  # noqa: E402

from kernels.page_copy_triton import PreparedCopy  # noqa: E402

MIB = 1 << 20
PAGE = 256 * 1024


@triton.jit
def _tma_device_desc(
    src_ptr,
    dst_ptr,
    src_ids,
    dst_ids,
    src_rows,
    dst_rows,
    rows_per_page,
    progs_per_page,
    chunks_per_prog,
    BR: tl.constexpr,
    BC: tl.constexpr,
    STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    pair = pid // progs_per_page
    part = pid % progs_per_page
    s = tl.load(src_ids + pair).to(tl.int32)
    d = tl.load(dst_ids + pair).to(tl.int32)
    sdesc = tl.make_tensor_descriptor(src_ptr, [src_rows, BC], [BC, 1], [BR, BC])
    ddesc = tl.make_tensor_descriptor(dst_ptr, [dst_rows, BC], [BC, 1], [BR, BC])
    first = part * chunks_per_prog * BR
    for k in tl.range(0, chunks_per_prog, num_stages=STAGES):
        x = sdesc.load([s * rows_per_page + first + k * BR, 0])
        ddesc.store([d * rows_per_page + first + k * BR, 0], x)


@triton.jit
def _tma_host_desc(
    sdesc,
    ddesc,
    src_ids,
    dst_ids,
    rows_per_page,
    progs_per_page,
    chunks_per_prog,
    BR: tl.constexpr,
    STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    pair = pid // progs_per_page
    part = pid % progs_per_page
    s = tl.load(src_ids + pair).to(tl.int32)
    d = tl.load(dst_ids + pair).to(tl.int32)
    first = part * chunks_per_prog * BR
    for k in tl.range(0, chunks_per_prog, num_stages=STAGES):
        x = sdesc.load([s * rows_per_page + first + k * BR, 0])
        ddesc.store([d * rows_per_page + first + k * BR, 0], x)


@triton.jit
def _plain_looped(
    src_ptr,
    dst_ptr,
    src_ids,
    dst_ids,
    row_elems,
    progs_per_page,
    chunks_per_prog,
    BLOCK: tl.constexpr,
):
    """The direct path's kernel, but one id read per program and a loop over its blocks."""
    pid = tl.program_id(0)
    pair = pid // progs_per_page
    part = pid % progs_per_page
    s = tl.load(src_ids + pair).to(tl.int64)
    d = tl.load(dst_ids + pair).to(tl.int64)
    first = part * chunks_per_prog * BLOCK
    for k in tl.range(0, chunks_per_prog):
        offs = first + k * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(src_ptr + s * row_elems + offs)
        tl.store(dst_ptr + d * row_elems + offs, x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.cuda.set_device(1)

    def device_ms(fn, repeats: int) -> float:
        return device_ms_on(fn, repeats, 1)

    triton.set_allocator(
        lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda:1")
    )
    pages = max(args.sizes_mib) * MIB // PAGE + 64
    words = PAGE // 4
    a = torch.randint(-(2**31), 2**31 - 1, (pages, words), dtype=torch.int32, device="cuda:0")
    b = torch.zeros((pages, words), dtype=torch.int32, device="cuda:1")
    b.view(-1)[:1].copy_(a.view(-1)[:1])  # peer access both ways
    a.view(-1)[:1].copy_(b.view(-1)[:1])
    plain = PreparedCopy(a.view(torch.uint8), b.view(torch.uint8))
    gen = torch.Generator().manual_seed(0)
    for mib in args.sizes_mib:
        n = mib * MIB // PAGE
        src = torch.randperm(pages - 1, generator=gen)[:n] + 1
        dst = torch.randperm(pages - 1, generator=gen)[:n] + 1
        src_d, dst_d = src.to("cuda:1"), dst.to("cuda:1")
        src_h, dst_h = src.pin_memory(), dst.pin_memory()
        flat_a, flat_b = a.view(-1)[: n * words], b.view(-1)[: n * words]
        print(f"== {mib} MiB ({n} pages): device ms, GB/s, variant / peer copy", flush=True)
        base = device_ms(lambda: flat_b.copy_(flat_a), args.repeats)

        def show(name: str, fn, check: bool = True) -> None:
            try:
                b.zero_()
                fn()
                torch.cuda.synchronize(1)
                if check and not torch.equal(b[dst_d], a[src.to("cuda:0")].to("cuda:1")):
                    print(f"   {name:<44} WRONG BYTES", flush=True)
                    return
                ms = device_ms(fn, args.repeats)
                gbps = n * PAGE / ms / 1e6
                print(f"   {name:<44} {ms:8.4f} ms {gbps:7.1f} GB/s {base / ms:5.2f}", flush=True)
            except Exception as e:  # noqa: BLE001  (an experiment: report, go on)
                print(f"   {name:<44} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                traceback.print_exc(limit=2)

        print(
            f"   {'peer copy (copy engines)':<44} {base:8.4f} ms "
            f"{n * PAGE / base / 1e6:7.1f} GB/s  1.00",
            flush=True,
        )
        show("plain kernel, ids on GPU 1", lambda: plain.launch(src_d, dst_d, n))
        show("plain kernel, ids pinned host", lambda: plain.launch(src_h, dst_h, n))
        for block, chunks in ((4096, 4), (4096, 16), (8192, 8)):
            progs = words // (block * chunks)

            def looped(block=block, chunks=chunks, progs=progs) -> None:
                _plain_looped[(n * progs,)](
                    a, b, src_h, dst_h, words, progs, chunks, BLOCK=block, num_warps=4
                )

            show(f"plain looped {block * 4 // 1024}KiB x{chunks}, pinned ids", looped)
        rows_total = pages * (words // 32)
        for bc, br, chunks, stages, warps in (
            (32, 128, 4, 3, 4),
            (32, 256, 4, 3, 4),
            (32, 256, 8, 4, 4),
            (64, 128, 8, 3, 4),
            (32, 256, 2, 2, 8),
        ):
            rpp = words // bc
            progs = rpp // (br * chunks)
            rows_total = pages * rpp
            name = f"[{br}x{bc * 4}B] x{chunks} st{stages} w{warps}"

            def dev_desc(
                bc=bc,
                br=br,
                chunks=chunks,
                stages=stages,
                warps=warps,
                rpp=rpp,
                progs=progs,
                rows_total=rows_total,
            ) -> None:
                _tma_device_desc[(n * progs,)](
                    a,
                    b,
                    src_h,
                    dst_h,
                    rows_total,
                    rows_total,
                    rpp,
                    progs,
                    chunks,
                    BR=br,
                    BC=bc,
                    STAGES=stages,
                    num_warps=warps,
                )

            show("TMA device desc " + name, dev_desc)
            try:
                from triton.tools.tensor_descriptor import TensorDescriptor

                sd = TensorDescriptor(a.view(rows_total, bc), [rows_total, bc], [bc, 1], [br, bc])
                dd = TensorDescriptor(b.view(rows_total, bc), [rows_total, bc], [bc, 1], [br, bc])
            except Exception as e:  # noqa: BLE001
                print(f"   host descriptors unavailable: {e}")
                continue

            def host_desc(
                sd=sd, dd=dd, br=br, chunks=chunks, stages=stages, warps=warps, rpp=rpp, progs=progs
            ) -> None:
                _tma_host_desc[(n * progs,)](
                    sd,
                    dd,
                    src_h,
                    dst_h,
                    rpp,
                    progs,
                    chunks,
                    BR=br,
                    STAGES=stages,
                    num_warps=warps,
                )

            show("TMA host desc   " + name, host_desc)


if __name__ == "__main__":
    main()
