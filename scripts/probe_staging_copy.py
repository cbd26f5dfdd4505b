"""Probe: what one staged chunk's page copies cost on this host's CPU, by method and thread.

The UCX path gathers a chunk's scattered pages into a staging buffer (P) and scatters them out of
one (D) on the transceiver's copy thread (transfer/staging.py). This times, for one 8 MiB chunk of
256 KiB pages in a memfd pool like a worker's (kvcache/kv_buffer.shared_zeros):

- index: torch.index_select / index_copy_ on int64 rows (what staging.py did until the ninth pass),
- foreach: one torch._foreach_copy_ of page views (one plain copy per page, one call),

each on the main thread and on a one-thread executor (the copy thread), on pages touched before
(warm) and on pages never touched (cold: the first write takes the pages), with torch's default
intra-op threads. Then the direct read's page-to-page copy (transfer/host_copy.py: one
_foreach_copy_ of page views) with the pages seen as uint8 rows (a 256 KiB page is 262144 elements,
more than torch's grain size of 32768, so each page copy is a parallel region of its own) and as
int64 rows (32768 elements: each page copy runs on one thread). Medians in ms.
Usage: python scripts/probe_staging_copy.py [--chunk-mib 8]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kvcache.kv_buffer import shared_zeros  # noqa: E402

PAGE = 256 * 1024


def gather_index(rows: torch.Tensor, ids: list[int], out: torch.Tensor) -> None:
    torch.index_select(rows, 0, torch.tensor(ids), out=out)


def scatter_index(staged: torch.Tensor, rows: torch.Tensor, ids: list[int]) -> None:
    rows.index_copy_(0, torch.tensor(ids), staged)


def gather_foreach(rows: torch.Tensor, ids: list[int], out: torch.Tensor) -> None:
    torch._foreach_copy_(list(out), [rows[i] for i in ids])


def scatter_foreach(staged: torch.Tensor, rows: torch.Tensor, ids: list[int]) -> None:
    torch._foreach_copy_([rows[i] for i in ids], list(staged))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunk-mib", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    per_chunk = args.chunk_mib * (1 << 20) // PAGE
    # Enough pages that every cold measurement gets pages of its own.
    num_pages = per_chunk * (4 * 2 * (args.repeats + 1) + 8)
    pool = shared_zeros((num_pages, PAGE // 8), torch.int64, "probe")
    staged = torch.empty(per_chunk, PAGE // 8, dtype=torch.int64)
    staged.fill_(1)
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(num_pages, generator=gen).tolist()
    warm = order[:per_chunk]
    pool[torch.tensor(warm)] = 2  # touched once
    cold_left = order[per_chunk:]
    executor = concurrent.futures.ThreadPoolExecutor(1)
    print(
        f"{os.cpu_count()} cores, torch intra-op threads {torch.get_num_threads()}, "
        f"{args.chunk_mib} MiB chunk of {per_chunk} pages, pool {num_pages * PAGE >> 20} MiB (memfd)"
    )
    for name, fn, kind in [
        ("gather index", gather_index, "gather"),
        ("gather foreach", gather_foreach, "gather"),
        ("scatter index", scatter_index, "scatter"),
        ("scatter foreach", scatter_foreach, "scatter"),
    ]:
        for where in ("main", "copy thread"):
            for temp in ("warm", "cold"):
                times = []
                for _ in range(args.repeats + 1):
                    if temp == "warm":
                        ids = warm
                    else:
                        ids, cold_left = cold_left[:per_chunk], cold_left[per_chunk:]
                    call = (fn, pool, ids, staged) if kind == "gather" else (fn, staged, pool, ids)
                    start = time.perf_counter()
                    if where == "main":
                        call[0](*call[1:])
                    else:
                        executor.submit(*call).result()
                    times.append(time.perf_counter() - start)
                print(
                    f"  {name:16s} {where:12s} {temp}: {statistics.median(times[1:]) * 1e3:7.3f} ms",
                    flush=True,
                )
    executor.shutdown()
    dst_pool = shared_zeros((num_pages, PAGE // 8), torch.int64, "probe-dst")
    dst_pool.fill_(3)  # warm
    src_ids, dst_ids = order[:per_chunk], order[per_chunk : 2 * per_chunk]
    for dtype in (torch.uint8, torch.int64):
        src, dst = pool.view(dtype), dst_pool.view(dtype)
        times = []
        for _ in range(args.repeats + 1):
            start = time.perf_counter()
            torch._foreach_copy_([dst[i] for i in dst_ids], [src[i] for i in src_ids])
            times.append(time.perf_counter() - start)
        print(
            f"  direct copy, pages as {str(dtype).removeprefix('torch.'):5s} rows (main, warm): "
            f"{statistics.median(times[1:]) * 1e3:7.3f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
