"""The direct read's page copy between host pools (transfer/host_copy.py): every page byte-exact
whether its run is copied whole or in serial pieces, rows that are not whole words included, and
ids outside the pools (or the null page) skipped."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from transfer import host_copy
from transfer.plan import DirectPlan


def pools(num_pages: int, page_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(page_bytes)
    src = torch.randint(0, 256, (num_pages, page_bytes), dtype=torch.uint8, generator=gen)
    return src, torch.zeros_like(src)


def copy(src: torch.Tensor, dst: torch.Tensor, s: list[int], d: list[int]) -> None:
    pair = ("p", "p", np.array(s, dtype=np.int64), np.array(d, dtype=np.int64))
    plan = DirectPlan((pair,), len(s) * src.shape[1])
    host_copy.copy_on_cpu(plan, {"p": src}, {"p": dst})


@pytest.mark.parametrize("page_bytes", [64, 8 * 40, 100])  # 100: not whole words
def test_short_and_long_runs_arrive_byte_exact(monkeypatch, page_bytes: int) -> None:
    # Small thresholds so a test-sized request has short runs cut in pieces and a long run.
    monkeypatch.setattr(host_copy, "PARALLEL_RUN_BYTES", 4 * page_bytes)
    monkeypatch.setattr(host_copy, "SERIAL_WORDS", 3)
    src, dst = pools(40, page_bytes)
    s = [5, 9, 10, 2, 20, 21, 22, 23, 24, 30]  # runs of 1, 2, 1 and 5 (long) pages, then 1
    d = [7, 11, 12, 1, 25, 26, 27, 28, 29, 3]
    copy(src, dst, s, d)
    assert torch.equal(dst[d], src[s])
    untouched = sorted(set(range(40)) - set(d))
    assert not dst[untouched].any()


def test_ids_outside_the_pools_and_the_null_page_are_skipped() -> None:
    src, dst = pools(8, 64)
    copy(src, dst, [0, 3, 99, 4], [5, 6, 7, -1])
    assert torch.equal(dst[6], src[3])
    assert not dst[[0, 1, 2, 3, 4, 5, 7]].any()  # pairs with the null page or no page copy nothing
