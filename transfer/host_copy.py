"""The page copy of a direct read between host pools (direct_read.py; on GPUs the copy is queued by
transfer/direct_copy.py instead)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from transfer.ipc import FIRST_ROW
from transfer.mapper import page_runs
from transfer.plan import DirectPlan


def copy_on_cpu(
    plan: DirectPlan,
    src_rows: Mapping[str, torch.Tensor],
    dst_rows: Mapping[str, torch.Tensor],
) -> None:
    """Copy every page of ``plan`` from P's rows into D's, both in host memory (P's in this
    process, or shared with it); done when this returns. Copies on GPUs go through
    transfer/direct_copy.py. Pairs with an id outside the pools, or the null page, are skipped
    (FIRST_ROW).

    One plain copy per run of pages consecutive on both sides, straight from P's rows into D's: an
    indexed copy would gather into a temporary first, and a fresh temporary of a large request
    costs more in page faults than the copy itself. All the runs go in one call, which lets go of
    the GIL once: a call per run would ask for the GIL back after every page, and a busy thread of
    the process (a worker's engine) keeps it for a switch interval each time (5 ms a page:
    docs/benchmarks/transfer.md)."""
    srcs: list[torch.Tensor] = []
    dsts: list[torch.Tensor] = []
    for sp, dp, s, d in plan.pairs:
        src, dst = src_rows[sp], dst_rows[dp]
        keep = (s >= FIRST_ROW) & (s < src.shape[0]) & (d >= FIRST_ROW) & (d < dst.shape[0])
        if not keep.all():
            s, d = s[keep], d[keep]
        src_words, dst_words = _flat_words(src), _flat_words(dst)
        # (Matched pools have equal pages; rows of unequal size take the checked copy_ path.)
        words = src_words is not None and dst_words is not None and src.shape[1] == dst.shape[1]
        row = src.shape[1] // 8
        for a, b, n in zip(*(r.tolist() for r in page_runs(s, d))):
            if not words or n * src.shape[1] >= PARALLEL_RUN_BYTES:
                srcs.append(src[a : a + n])
                dsts.append(dst[b : b + n])
                continue
            for off in range(0, n * row, SERIAL_WORDS):  # short runs: serial pieces
                take = min(SERIAL_WORDS, n * row - off)
                srcs.append(src_words[a * row + off : a * row + off + take])
                dsts.append(dst_words[b * row + off : b * row + off + take])
    if dsts:
        torch._foreach_copy_(dsts, srcs)


# torch runs a copy of more than its grain size (32768 elements) as a parallel region over all of
# its threads. For a short run that region costs more than the bytes once there are many threads:
# scattered 256 KiB pages read at 2.7 GB/s on 32 cores against 16+ GB/s for one long run
# (docs/benchmarks/transfer.md, ninth pass). So runs shorter than PARALLEL_RUN_BYTES are copied in
# pieces of at most SERIAL_WORDS words, each on the calling thread; long runs keep the parallel copy.
PARALLEL_RUN_BYTES = 4 << 20
SERIAL_WORDS = 32768


def _flat_words(rows: torch.Tensor) -> torch.Tensor | None:
    """The rows' bytes as one flat int64 view, or None when the rows are not whole words."""
    if not rows.is_contiguous() or rows.shape[1] % 8 or rows.data_ptr() % 8:
        return None
    return rows.view(-1).view(torch.int64)
