"""The CPU attention path (kernels/attention_cpu.py) against its plain-torch twins on random paged
inputs: GQA, sliding windows, prefix-cached contexts, ragged and mixed batches, float32 and bf16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.attention_cpu import (
    paged_decode_attention_cpu,
    paged_prefill_attention_cpu,
    prefill_groups,
    store_kv_cpu,
)
from kernels.attention_ref import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    store_kv_ref,
)
from tests.kernels.paged_inputs import make_paged_kv, pack_queries

# (dtype, max abs difference to the reference): both compute in float32; bf16 outputs round once.
DTYPES = [(torch.float32, 2e-6), (torch.bfloat16, 2**-6)]
HEADS = [(9, 3), (4, 4), (8, 1)]


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window", [None, 13, 1])
def test_decode_matches_reference(
    dtype: torch.dtype, tol: float, heads: tuple[int, int], window: int | None
) -> None:
    gen = torch.Generator().manual_seed(11)
    num_q, num_kv = heads
    seq_lens = [37, 5, 64, 1, 16, 200, 33]
    kv = make_paged_kv(seq_lens, 16, num_kv, 32, dtype, gen)
    q = torch.randn((len(seq_lens), num_q, 32), generator=gen).to(dtype)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, 0.17, window)
    out = paged_decode_attention_cpu(*args)
    assert out.shape == q.shape and out.dtype == dtype
    assert float((out.double() - paged_decode_attention_ref(*args).double()).abs().max()) <= tol


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
# groups); a single sequence.
CASES = [
    ([33, 7, 16, 2], [33, 7, 16, 2]),
    ([5, 40, 3], [37, 90, 3]),
    ([1, 0, 20, 1, 1, 9], [50, 12, 20, 7, 33, 41]),
    ([300, 4, 6, 5, 1], [300, 4, 6, 21, 64]),
    ([64], [64]),
]


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize(("q_lens", "ctx"), CASES)
def test_prefill_matches_reference(
    dtype: torch.dtype,
    tol: float,
    heads: tuple[int, int],
    window: int | None,
    q_lens: list[int],
    ctx: list[int],
) -> None:
    gen = torch.Generator().manual_seed(13)
    num_q, num_kv = heads
    kv = make_paged_kv(ctx, 8, num_kv, 32, dtype, gen)
    q, cu = pack_queries(q_lens, num_q, 32, dtype, gen)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, cu, kv.seq_lens, 0.2, window)
    out = paged_prefill_attention_cpu(*args)
    assert out.shape == q.shape and out.dtype == dtype
    assert float((out.double() - paged_prefill_attention_ref(*args).double()).abs().max()) <= tol


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
        layer = expected[:, 1]
        store_kv_ref(key, value, layer[:, 0], layer[:, 1], slots)
        store_kv_cpu(key, value, kv.k_cache, kv.v_cache, slots)
        assert torch.equal(kv.buffer, expected)
