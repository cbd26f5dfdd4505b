"""The CPU attention path (duet_kernels/attention_cpu.py) against its plain-torch twins on random paged
inputs: GQA, sliding windows (over window-group tables that hold the null page where pages left the
window), soft-capped scores, prefix-cached contexts, ragged and mixed batches, float32 and bf16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from duet_kernels.attention_cpu import (
    paged_decode_attention_cpu,
    paged_prefill_attention_cpu,
    plan_decode,
    plan_prefill,
    prefill_groups,
    store_kv_cpu,
)
from duet_kernels.attention_ref import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    store_kv_ref,
)
from kvcache.kv_buffer import layer_view
from kvcache.spec import NULL_PAGE
from tests.duet_kernels.paged_inputs import PagedKV, make_paged_kv, pack_queries

# (dtype, max abs difference to the reference): both compute in float32; bf16 outputs round once.
DTYPES = [(torch.float32, 2e-6), (torch.bfloat16, 2**-6)]
HEADS = [(9, 3), (4, 4), (8, 1)]


def window_table(kv: PagedKV, first_keys: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A window group's view of ``kv``: its table with the null page where row b's pages lie wholly
    before key ``first_keys[b]`` (released by the KV manager), and a copy of the pool whose released
    pages hold NaN (a path that reads one gets NaN out)."""
    page_size = kv.k_cache.shape[1]
    table = kv.page_table.clone()
    poisoned = kv.buffer.clone()
    for b, first in enumerate(first_keys):
        gone = first // page_size
        for page in table[b, :gone].tolist():
            poisoned[page] = float("nan")
        table[b, :gone] = NULL_PAGE
    return table, poisoned


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window", [None, 13, 1])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_decode_matches_reference(
    dtype: torch.dtype,
    tol: float,
    heads: tuple[int, int],
    window: int | None,
    softcap: float | None,
) -> None:
    gen = torch.Generator().manual_seed(11)
    num_q, num_kv = heads
    seq_lens = [37, 5, 64, 1, 16, 200, 33]
    kv = make_paged_kv(seq_lens, 16, num_kv, 32, dtype, gen)
    q = torch.randn((len(seq_lens), num_q, 32), generator=gen)
    if softcap is not None:  # scores large enough that the cap bites
        q = 3 * q
    q = q.to(dtype)
    table, buffer = kv.page_table, kv.buffer
    if window is not None:  # the window group's table and pool: released pages are never read
        table, buffer = window_table(kv, [max(0, n - window) for n in seq_lens])
    k_cache, v_cache = layer_view(buffer, 1)
    out = paged_decode_attention_cpu(q, k_cache, v_cache, table, kv.seq_lens, 0.17, window, softcap)
    assert out.shape == q.shape and out.dtype == dtype
    expected = paged_decode_attention_ref(
        q, kv.k_cache, kv.v_cache, table, kv.seq_lens, 0.17, window, softcap
    )
    assert float((out.double() - expected.double()).abs().max()) <= tol


def test_a_decode_window_gathers_only_its_pages() -> None:
    gen = torch.Generator().manual_seed(15)
    seq_lens = [203, 37, 16, 1]
    kv = make_paged_kv(seq_lens, 8, 2, 16, torch.float32, gen)
    plan = plan_decode(kv.page_table, kv.seq_lens, 8, sliding_window=20)
    # a window of 20 keys spans at most 4 pages of 8; rows read from the page of their first key
    ids = plan.page_ids.view(4, -1)
    assert ids.shape[1] == 4
    assert ids[0].tolist() == kv.page_table[0, 22:26].tolist()
    assert ids[1].tolist() == kv.page_table[1, 2:5].tolist() + [NULL_PAGE]
    assert ids[3].tolist() == [kv.page_table[3, 0].item(), NULL_PAGE, NULL_PAGE, NULL_PAGE]
    assert plan.mask is not None and plan.mask.shape == (4, 1, 1, 32)
    assert plan.mask[0, 0, 0].nonzero().flatten().tolist() == list(range(7, 27))  # keys 183..202


def test_decode_without_a_window_or_padding_needs_no_mask() -> None:
    gen = torch.Generator().manual_seed(16)
    kv = make_paged_kv([32, 32], 16, 2, 16, torch.float32, gen)
    plan = plan_decode(kv.page_table, kv.seq_lens, 16)
    assert plan.mask is None and plan.page_ids.tolist() == kv.page_table[:, :2].flatten().tolist()


def test_decode_of_an_empty_batch_is_empty() -> None:
    gen = torch.Generator().manual_seed(12)
    kv = make_paged_kv([4], 4, 2, 16, torch.float32, gen)
    q = torch.empty((0, 4, 16))
    out = paged_decode_attention_cpu(
        q, kv.k_cache, kv.v_cache, kv.page_table[:0], kv.seq_lens[:0], 0.25
    )
    assert out.shape == (0, 4, 16)


# (query lengths, context lengths): fresh prompts of mixed lengths; chunks over cached prefixes;
# a mixed batch of decodes, idle rows and prefills; one long prompt among short ones (several
# groups); a single sequence; a burst of equal fresh prompts and equal chunks over prefixes
# taken longest first (groups whose packed rows are already padded, no row mapping); equal
# chunks out of that order (mapped).
CASES = [
    ([33, 7, 16, 2], [33, 7, 16, 2]),
    ([5, 40, 3], [37, 90, 3]),
    ([1, 0, 20, 1, 1, 9], [50, 12, 20, 7, 33, 41]),
    ([300, 4, 6, 5, 1], [300, 4, 6, 21, 64]),
    ([64], [64]),
    ([16, 16, 16, 16], [16, 16, 16, 16]),
    ([8, 8, 8], [40, 30, 20]),
    ([8, 8, 8], [8, 40, 20]),
]


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize(("q_lens", "ctx"), CASES)
def test_prefill_matches_reference(
    dtype: torch.dtype,
    tol: float,
    heads: tuple[int, int],
    window: int | None,
    softcap: float | None,
    q_lens: list[int],
    ctx: list[int],
) -> None:
    gen = torch.Generator().manual_seed(13)
    num_q, num_kv = heads
    kv = make_paged_kv(ctx, 8, num_kv, 32, dtype, gen)
    q, cu = pack_queries(q_lens, num_q, 32, dtype, gen)
    if softcap is not None:  # scores large enough that the cap bites
        q = 3 * q
    table, buffer = kv.page_table, kv.buffer
    if window is not None:  # pages wholly before the first query's window are released
        table, buffer = window_table(
            kv, [max(0, c - n - window + 1) for n, c in zip(q_lens, ctx, strict=True)]
        )
    k_cache, v_cache = layer_view(buffer, 1)
    out = paged_prefill_attention_cpu(
        q, k_cache, v_cache, table, cu, kv.seq_lens, 0.2, window, softcap
    )
    assert out.shape == q.shape and out.dtype == dtype
    expected = paged_prefill_attention_ref(
        q, kv.k_cache, kv.v_cache, table, cu, kv.seq_lens, 0.2, window, softcap
    )
    assert float((out.double() - expected.double()).abs().max()) <= tol


def test_a_plan_serves_every_layer_of_its_step() -> None:
    """One plan, two layers of the pool: each layer's output equals its own unplanned call."""
    gen = torch.Generator().manual_seed(17)
    q_lens, ctx = [5, 1, 20], [37, 12, 20]
    kv = make_paged_kv(ctx, 8, 2, 16, torch.float32, gen)
    q, cu = pack_queries(q_lens, 4, 16, torch.float32, gen)
    plan = plan_prefill(kv.page_table, cu, kv.seq_lens, 8, sliding_window=9)
    for layer in (0, 1):
        k_cache, v_cache = layer_view(kv.buffer, layer)
        args = (q, k_cache, v_cache, kv.page_table, cu, kv.seq_lens, 0.25, 9)
        planned = paged_prefill_attention_cpu(*args, plan=plan)
        assert torch.equal(planned, paged_prefill_attention_cpu(*args))
        assert float((planned - paged_prefill_attention_ref(*args)).abs().max()) <= 2e-6


def test_groups_of_already_padded_rows_need_no_row_mapping() -> None:
    cu = torch.tensor([0, 8, 16, 24], dtype=torch.int32)
    table = torch.arange(1, 16, dtype=torch.int32).view(3, 5)
    in_order = plan_prefill(table, cu, torch.tensor([40, 30, 20], dtype=torch.int32), 8)
    assert [g.src is None for g in in_order.groups] == [True]
    out_of_order = plan_prefill(table, cu, torch.tensor([8, 40, 20], dtype=torch.int32), 8)
    assert [g.src is None for g in out_of_order.groups] == [False]


def test_prefill_groups_bound_the_padding() -> None:
    q_lens = np.array([300, 4, 6, 5, 1, 0, 250])
    ctx = np.array([300, 4, 6, 21, 64, 9, 260])
    groups = prefill_groups(q_lens, ctx)
    # longest contexts first; one-token and idle rows are not prefill groups
    assert [g.tolist() for g in groups] == [[0, 6, 3], [2, 1]]
    for g in groups:
        padded = len(g) * q_lens[g].max() * ctx[g].max()
        assert padded <= max(2.0 * (q_lens[g] * ctx[g]).sum(), 64 * 1024)


def test_store_kv_matches_reference_with_padding_slots() -> None:
    gen = torch.Generator().manual_seed(14)
    kv = make_paged_kv([10, 10], 4, 2, 16, torch.bfloat16, gen)
    key = torch.randn((5, 2, 16), generator=gen)
    value = torch.randn((5, 2, 16), generator=gen)
    for slots in (torch.tensor([6, -1, 13, 0, 21]), torch.tensor([6, 7, 13, 0, 21])):
        expected = kv.buffer.clone()
        store_kv_ref(key, value, *layer_view(expected, 1), slots)
        store_kv_cpu(key, value, kv.k_cache, kv.v_cache, slots)
        assert torch.equal(kv.buffer, expected)
