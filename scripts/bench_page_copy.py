"""Benchmark: page-to-page copies between two GPUs of one host, the kernel of the direct-copy data
path (transfer/ipc.py), next to a torch peer copy of the same bytes in the same run.

    python scripts/bench_page_copy.py --out results.json      # needs 2 GPUs

Variants, each the median wall time of --repeats runs (launch + synchronize, like the peer copy;
the Python launch is in it, so small sizes understate the kernel: scripts/probe_read_path.py times
the device alone):
push (kernel on GPU 0 writes GPU 1's pool, as the prefill side does), pull (kernel on GPU 1 reads
GPU 0's pool), page order as given / sorted by destination, pages in one run (contiguous) or a
random permutation (scattered), a few program sizes, and the copy engines through one
``cudaMemcpyBatchAsync`` per request (scripts/ce_batch_copy.py; pulled by GPU 1 or pushed by GPU 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ce_batch_copy as batch_memcpy  # noqa: E402
import torch  # noqa: E402

from kernels.page_copy_triton import copy_pages  # noqa: E402

MIB = 1 << 20
PAGE = 256 * 1024


def timed(fn, repeats: int) -> float:
    times = []
    for rep in range(repeats + 1):
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        if rep:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    pages = max(args.sizes_mib) * MIB // PAGE + 64
    a = torch.randint(-(2**62), 2**62, (pages, PAGE // 8), dtype=torch.int64, device="cuda:0")
    b = torch.zeros((pages, PAGE // 8), dtype=torch.int64, device="cuda:1")
    b.view(-1)[:1].copy_(a.view(-1)[:1])  # enables peer access both ways, as IPC opening does
    a.view(-1)[:1].copy_(b.view(-1)[:1])
    gen = torch.Generator().manual_seed(0)
    streams = [torch.cuda.Stream(device=d) for d in (0, 1)]
    print(f"batched copy-engine memcpy available: {batch_memcpy.available()}", flush=True)
    rows = []
    for size in args.sizes_mib:
        n = size * MIB // PAGE
        flat_a, flat_b = a.view(-1)[: size * MIB // 8], b.view(-1)[: size * MIB // 8]
        row = {
            "mib": size,
            "peer_copy": timed(lambda fa=flat_a, fb=flat_b: fb.copy_(fa), args.repeats),
        }
        layouts = {
            "contiguous": (torch.arange(1, n + 1), torch.arange(1, n + 1)),
            "scattered": (
                torch.randperm(pages - 1, generator=gen)[:n] + 1,
                torch.randperm(pages - 1, generator=gen)[:n] + 1,
            ),
        }
        for layout, (src_ids, dst_ids) in layouts.items():
            order = torch.argsort(dst_ids)
            variants = {
                "push": (0, src_ids, dst_ids, 16384, 4),
                "push_sorted": (0, src_ids[order], dst_ids[order], 16384, 4),
                "push_64k_w8": (0, src_ids, dst_ids, 65536, 8),
                "push_4k_w4": (0, src_ids, dst_ids, 4096, 4),
                "pull": (1, src_ids, dst_ids, 16384, 4),
                "pull_sorted_src": (
                    1,
                    src_ids[torch.argsort(src_ids)],
                    dst_ids[torch.argsort(src_ids)],
                    16384,
                    4,
                ),
                "pull_64k_w8": (1, src_ids, dst_ids, 65536, 8),
                "pull_32k_w4": (1, src_ids, dst_ids, 32768, 4),
                "pull_8k_w4": (1, src_ids, dst_ids, 8192, 4),
                "pull_4k_w2": (1, src_ids, dst_ids, 4096, 2),
            }
            for name, (dev, s, d, block, warps) in variants.items():
                s_dev, d_dev = s.to(f"cuda:{dev}"), d.to(f"cuda:{dev}")

                def run(dev=dev, s_dev=s_dev, d_dev=d_dev, block=block, warps=warps) -> None:
                    with torch.cuda.device(dev):
                        copy_pages(a, s_dev, b, d_dev, block_bytes=block, num_warps=warps)

                row[f"{layout}_{name}"] = timed(run, args.repeats)
                assert torch.equal(
                    b[d_dev[:4].to("cuda:1")], a[s_dev[:4].to("cuda:0")].to("cuda:1")
                )
            if batch_memcpy.available():
                s_np, d_np = src_ids.numpy(), dst_ids.numpy()
                for name, dev in (("batch_ce_pull", 1), ("batch_ce_push", 0)):
                    stream = streams[dev]

                    def run_ce(stream=stream, s_np=s_np, d_np=d_np) -> None:
                        batch_memcpy.copy_pages_batched(a, s_np, b, d_np, stream)

                    row[f"{layout}_{name}"] = timed(run_ce, args.repeats)
                    assert torch.equal(b[d_np[:4]], a[s_np[:4]].to("cuda:1"))
        if size <= 64:  # one copy engine call per page
            s, d = layouts["scattered"]
            pairs = list(zip(s.tolist(), d.tolist()))

            def per_page(pairs=pairs) -> None:
                for i, j in pairs:
                    b[j].copy_(a[i], non_blocking=True)

            row["scattered_copy_engine_per_page"] = timed(per_page, args.repeats)
        line = {k: (v if k == "mib" else round(size * MIB / v / 1e9, 1)) for k, v in row.items()}
        rows.append(line)
        print(json.dumps(line), flush=True)
    if args.out:
        args.out.write_text(
            json.dumps({"unit": "GB/s", "page_bytes": PAGE, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
