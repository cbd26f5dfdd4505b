"""The Triton kernels vs their references on a CUDA device, at realistic shapes and 16-bit dtypes.

Each test records its max abs error (pytest `record_property`, so it lands in --junitxml output)
and prints it (-s). Skipped without CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch

import duet_kernels
from kvcache.kv_buffer import layer_view
from tests.duet_kernels.paged_inputs import make_paged_kv, pack_queries

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# |kernel - reference| <= atol + rtol * |reference|: both round the output to the dtype, and the
# kernel also rounds the softmax weights to it before the P @ V product.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 4e-3),
    torch.bfloat16: (1e-2, 2e-2),
}
DTYPES = list(TOLERANCES)


def _check_close(
    name: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, record
) -> None:
    atol, rtol = TOLERANCES[dtype]
    diff = (out.double() - ref.double()).abs()
    max_err = float(diff.max())
    record(f"{name}_max_abs_error", max_err)
    print(f"{name}: max abs error {max_err:.3e}")
    assert not torch.isnan(out).any()
    assert bool((diff <= atol + rtol * ref.double().abs()).all()), (
        f"{name}: max abs error {max_err}"
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("head_dim", "page_size", "heads", "window"),
    [
        (128, 16, (32, 8), None),  # Llama-3-8B
        (128, 32, (32, 8), 1000),
        (64, 16, (16, 16), None),
        (64, 32, (28, 4), 257),
    ],
)
def test_decode_matches_reference(
    dtype, head_dim, page_size, heads, window, record_property
) -> None:
    gen = torch.Generator().manual_seed(head_dim + page_size)
    seq_lens = torch.randint(1, 3000, (12,), generator=gen).tolist() + [1, 4096]
    kv = make_paged_kv(
        seq_lens, page_size, heads[1], head_dim, dtype, gen, device="cuda", num_layers=3
    )
    q = torch.randn((len(seq_lens), heads[0], head_dim), generator=gen).to(dtype).cuda()
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, 1 / math.sqrt(head_dim), window)
    out = duet_kernels.paged_decode_attention(*args)
    ref = duet_kernels.paged_decode_attention_ref(*args)
    _check_close(
        f"decode_{dtype}_d{head_dim}_p{page_size}_w{window}", out, ref, dtype, record_property
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("head_dim", "page_size", "heads", "window"),
    [
        (128, 16, (32, 8), None),
        (128, 32, (32, 8), 300),
        (64, 16, (8, 8), None),
    ],
)
def test_prefill_matches_reference(
    dtype, head_dim, page_size, heads, window, record_property
) -> None:
    gen = torch.Generator().manual_seed(head_dim * page_size)
    q_lens = [700, 1, 0, 1024, 129]
    prefixes = [300, 2000, 50, 0, 1111]
    ctx = [q + p for q, p in zip(q_lens, prefixes, strict=True)]
    kv = make_paged_kv(ctx, page_size, heads[1], head_dim, dtype, gen, device="cuda", num_layers=3)
    q, cu = pack_queries(q_lens, heads[0], head_dim, dtype, gen, device="cuda")
    args = (
        q,
        kv.k_cache,
        kv.v_cache,
        kv.page_table,
        cu,
        kv.seq_lens,
        1 / math.sqrt(head_dim),
        window,
    )
    out = duet_kernels.paged_prefill_attention(*args)
    ref = duet_kernels.paged_prefill_attention_ref(*args)
    _check_close(
        f"prefill_{dtype}_d{head_dim}_p{page_size}_w{window}", out, ref, dtype, record_property
    )


@pytest.mark.parametrize(
    ("src_dtype", "cache_dtype"),
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float16),
    ],
)
def test_store_kv_matches_reference_exactly(src_dtype, cache_dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    kv = make_paged_kv([900, 300], 16, 8, 128, cache_dtype, gen, device="cuda", num_layers=3)
    expected = kv.buffer.clone()
    slots = torch.randperm(kv.buffer.shape[0] * 16, generator=gen)[:513]
    slots[::7] = -1
    key = torch.randn((513, 8, 128), generator=gen).to(src_dtype).cuda()
    value = torch.randn((513, 16, 128), generator=gen).to(src_dtype).cuda()[:, ::2]
    duet_kernels.store_kv(key, value, kv.k_cache, kv.v_cache, slots.cuda())
    duet_kernels.store_kv_ref(key, value, *layer_view(expected, 1), slots.cuda())
    assert torch.equal(kv.buffer, expected)


@pytest.mark.parametrize(("row_bytes", "offset"), [(4 << 20, 0), (1000, 0), (333, 1)])
def test_gather_scatter_match_reference_exactly(row_bytes: int, offset: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(6)
    pool = torch.randint(
        0, 256, (64, row_bytes + offset), dtype=torch.uint8, device="cuda", generator=gen
    )[:, offset:]
    ids = torch.randperm(63, device="cuda", generator=gen)[:20] + 1
    staged = torch.full((20, row_bytes), 7, dtype=torch.uint8, device="cuda")
    duet_kernels.gather_pages(pool, ids, staged)
    assert torch.equal(staged, pool[ids])
    dst = torch.zeros((64, row_bytes), dtype=torch.uint8, device="cuda")
    duet_kernels.scatter_pages(staged, dst, ids)
    expected = torch.zeros_like(dst)
    expected[ids] = pool[ids]
    assert torch.equal(dst, expected)


@pytest.mark.parametrize(
    ("row_bytes", "peer"), [(256 << 10, False), (1000, False), (256 << 10, True)]
)
def test_copy_pages_matches_reference_exactly(row_bytes: int, peer: bool) -> None:
    if peer and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    gen = torch.Generator(device="cuda").manual_seed(7)
    src = torch.randint(0, 256, (64, row_bytes), dtype=torch.uint8, device="cuda:0", generator=gen)
    dst = torch.zeros((80, row_bytes), dtype=torch.uint8, device="cuda:1" if peer else "cuda:0")
    src_ids = torch.randperm(63, device="cuda:0", generator=gen)[:30] + 1
    dst_ids = torch.randperm(79, device="cuda:0", generator=gen)[:30] + 1
    if peer:  # GPU 0 writes GPU 1's pool over NVLink, as the CUDA IPC path of transfer/ does
        torch.empty(1, device="cuda:1").copy_(torch.ones(1, device="cuda:0"))  # enables peer access
    with torch.cuda.device(0):
        duet_kernels.copy_pages(src, src_ids, dst, dst_ids)
    torch.cuda.synchronize(0)
    expected = torch.zeros_like(dst)
    expected[dst_ids.to(dst.device)] = src[src_ids].to(dst.device)
    assert torch.equal(dst, expected)


def test_copy_pages_repeats_exactly_and_skips_ids_outside_the_pools() -> None:
    """The direct reads' launch: a side stream, other ids each time, word rows; pairs with an id
    outside [first_row, rows) are skipped, the others in the launch copied."""
    gen = torch.Generator(device="cuda").manual_seed(8)
    src = torch.randint(0, 256, (64, 32 << 10), dtype=torch.uint8, device="cuda", generator=gen)
    dst = torch.zeros((80, 32 << 10), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    expected = torch.zeros_like(dst)
    cpu_gen = torch.Generator().manual_seed(9)
    for n in (1, 30, 7, 63):
        s_ids = torch.randperm(63, generator=cpu_gen)[:n] + 1
        d_ids = torch.randperm(79, generator=cpu_gen)[:n] + 1
        with torch.cuda.stream(stream):
            duet_kernels.copy_pages(src.view(torch.int64), s_ids, dst.view(torch.int64), d_ids, 1)
        stream.synchronize()
        expected[d_ids.cuda()] = src[s_ids.cuda()]
        assert torch.equal(dst, expected), n
    s_ids = torch.tensor([0, 64, 5, -2, 9, 3])
    d_ids = torch.tensor([3, 4, 80, 0, 0, 6])
    duet_kernels.copy_pages(src.view(torch.int64), s_ids, dst.view(torch.int64), d_ids, 1)
    torch.cuda.synchronize()
    expected[6] = src[3]
    assert torch.equal(dst, expected)
    assert int(dst[0].count_nonzero()) == 0  # the null page is never written


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap_kernels_match_reference(dtype, record_property) -> None:
    """Gemma-shaped soft-capped attention (head_dim 256, window 512 and none), decode and prefill."""
    gen = torch.Generator().manual_seed(7)
    head_dim, page_size, heads, cap = 256, 16, (8, 4), 50.0
    scale = 0.5  # scores of tens: the cap bites
    for window in (512, None):
        ctx = [1500, 1, 700]
        kv = make_paged_kv(ctx, page_size, heads[1], head_dim, dtype, gen, device="cuda")
        q = torch.randn((len(ctx), heads[0], head_dim), generator=gen).to(dtype).cuda()
        args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, scale, window, cap)
        out, ref = (
            duet_kernels.paged_decode_attention(*args),
            duet_kernels.paged_decode_attention_ref(*args),
        )
        _check_close(f"decode_softcap_{dtype}_w{window}", out, ref, dtype, record_property)
        qp, cu = pack_queries([300, 1, 700], heads[0], head_dim, dtype, gen, device="cuda")
        args = (qp, kv.k_cache, kv.v_cache, kv.page_table, cu, kv.seq_lens, scale, window, cap)
        out = duet_kernels.paged_prefill_attention(*args)
        ref = duet_kernels.paged_prefill_attention_ref(*args)
        _check_close(f"prefill_softcap_{dtype}_w{window}", out, ref, dtype, record_property)
