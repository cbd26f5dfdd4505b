"""The attention references (the CPU implementation and the Triton kernels' oracle) against dense
causal attention through torch SDPA on contiguous K/V, and store_kv_ref against direct indexing."""

from __future__ import annotations

import math

import pytest
import torch

from duet_kernels import paged_decode_attention_ref, paged_prefill_attention_ref, store_kv_ref
from tests.duet_kernels.paged_inputs import (
    eager_softcap_oracle,
    make_paged_kv,
    pack_queries,
    sdpa_oracle,
)

# (dtype, tolerance on max abs error vs the float64 oracle): the reference computes in float32 and
# rounds its output to the input dtype (one bf16 ulp is 2**-7 relative, outputs here are below 4).
DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2**-6)]


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize(
    ("heads", "window"), [((8, 2), None), ((4, 4), None), ((8, 2), 13), ((2, 1), 1)]
)
def test_decode_ref_matches_dense_sdpa(
    dtype: torch.dtype, tol: float, heads: tuple[int, int], window: int | None
) -> None:
    gen = torch.Generator().manual_seed(1)
    num_q, num_kv = heads
    seq_lens = [37, 5, 64, 1, 16]
    kv = make_paged_kv(seq_lens, 16, num_kv, 32, dtype, gen)
    q = torch.randn((len(seq_lens), num_q, 32), generator=gen).to(dtype)
    scale = 1 / math.sqrt(32)
    out = paged_decode_attention_ref(
        q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, scale, window
    )
    assert out.shape == q.shape and out.dtype == dtype
    for b in range(len(seq_lens)):
        expected = sdpa_oracle(q[b : b + 1], kv.dense_k[b], kv.dense_v[b], scale, window)[0]
        assert float((out[b].double() - expected).abs().max()) <= tol


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize("window", [None, 7])
def test_prefill_ref_matches_dense_sdpa(dtype: torch.dtype, tol: float, window: int | None) -> None:
    gen = torch.Generator().manual_seed(2)
    # a chunk over a cached prefix, an idle sequence, a whole prompt, one token over a long prefix
    q_lens, ctx = [5, 0, 33, 1], [37, 20, 33, 50]
    kv = make_paged_kv(ctx, 8, 2, 32, dtype, gen)
    q, cu = pack_queries(q_lens, 6, 32, dtype, gen)
    scale = 0.2
    out = paged_prefill_attention_ref(
        q, kv.k_cache, kv.v_cache, kv.page_table, cu, kv.seq_lens, scale, window
    )
    assert out.shape == q.shape
    for b, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        if start == end:
            continue
        expected = sdpa_oracle(q[start:end], kv.dense_k[b], kv.dense_v[b], scale, window)
        assert float((out[start:end].double() - expected).abs().max()) <= tol


def test_prefill_ref_single_token_equals_decode_ref() -> None:
    gen = torch.Generator().manual_seed(3)
    kv = make_paged_kv([9, 30], 4, 2, 16, torch.float32, gen)
    q = torch.randn((2, 4, 16), generator=gen)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    args = (kv.k_cache, kv.v_cache, kv.page_table)
    prefill = paged_prefill_attention_ref(q, *args, cu, kv.seq_lens, 0.25, 5)
    decode = paged_decode_attention_ref(q, *args, kv.seq_lens, 0.25, 5)
    torch.testing.assert_close(prefill, decode, rtol=0, atol=1e-6)


def test_store_kv_ref_writes_exactly_the_mapped_slots() -> None:
    gen = torch.Generator().manual_seed(4)
    kv = make_paged_kv([10, 10], 4, 2, 16, torch.float16, gen)
    before = kv.buffer.clone()
    key = torch.randn((4, 2, 16), generator=gen)
    value = torch.randn((4, 2, 16), generator=gen)
    slots = torch.tensor([6, -1, 13, 0])  # page 1 slot 2, padding, page 3 slot 1, page 0 slot 0
    store_kv_ref(key, value, kv.k_cache, kv.v_cache, slots)
    expected = before.clone()
    for t, (page, off) in {0: (1, 2), 2: (3, 1), 3: (0, 0)}.items():
        # [page, head, layer, k/v, slot, D]: layer 1 is the view under test
        expected[page, :, 1, 0, off] = key[t].half()
        expected[page, :, 1, 1, off] = value[t].half()
    assert torch.equal(kv.buffer, expected)


@pytest.mark.parametrize("window", [None, 9])
def test_softcap_refs_match_transformers_eager(window: int | None) -> None:
    """Scores large enough that the cap bites (|score| up to ~4x the cap), decode and prefill."""
    gen = torch.Generator().manual_seed(3)
    ctx = [37, 5, 20]
    kv = make_paged_kv(ctx, 8, 2, 32, torch.float32, gen)
    scale, cap = 1.0, 5.0
    q = 3 * torch.randn((len(ctx), 4, 32), generator=gen)
    out = paged_decode_attention_ref(
        q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, scale, window, cap
    )
    uncapped = paged_decode_attention_ref(
        q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, scale, window
    )
    assert float((out - uncapped).abs().max()) > 0.1  # the cap changes the result
    for b in range(len(ctx)):
        expected = eager_softcap_oracle(
            q[b : b + 1], kv.dense_k[b], kv.dense_v[b], scale, cap, window
        )[0]
        assert float((out[b].double() - expected).abs().max()) <= 1e-5
    q_lens = [5, 0, 20]
    qp, cu = pack_queries(q_lens, 4, 32, torch.float32, gen)
    qp = 3 * qp
    out = paged_prefill_attention_ref(
        qp, kv.k_cache, kv.v_cache, kv.page_table, cu, kv.seq_lens, scale, window, cap
    )
    for b, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        if start == end:
            continue
        expected = eager_softcap_oracle(
            qp[start:end], kv.dense_k[b], kv.dense_v[b], scale, cap, window
        )
        assert float((out[start:end].double() - expected).abs().max()) <= 1e-5
