"""The page copy of a direct read between host pools (direct_read.py; on GPUs the copy is queued by
transfer/direct_copy.py instead)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from transfer.ipc import FIRST_ROW
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
        for a, b, n in _runs(s, d):
            srcs.append(src[a : a + n])
            dsts.append(dst[b : b + n])
    if dsts:
        torch._foreach_copy_(dsts, srcs)


def _runs(s: np.ndarray, d: np.ndarray) -> list[tuple[int, int, int]]:
    """(first source id, first destination id, length) of each run of pairs where both ids go up
    by one."""
    if len(s) == 0:
        return []
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(s)])))
    return list(zip(s[starts].tolist(), d[starts].tolist(), lengths.tolist(), strict=True))
