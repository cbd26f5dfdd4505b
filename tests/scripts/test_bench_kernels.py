"""scripts/bench_kernels.py builds its pools as the engine does (CUDA-only as a whole; its pools
are checked here on CPU): the page layout of kvcache/spec.py, the K/V views of
kvcache.kv_buffer.layer_view, and the contiguous K/V of its SDPA baseline are the same tokens."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from duet_kernels import paged_decode_attention_ref
from kvcache.kv_buffer import layer_view

pytest.importorskip("triton")  # the script imports it (its kernels are Triton's)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_kernels.py"


def bench_kernels():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("bench_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pools_are_in_the_engines_page_layout_and_match_the_sdpa_baseline() -> None:
    bk = bench_kernels()
    torch.manual_seed(0)
    lens, page_size = [5, 13, 8], 4
    k_cache, v_cache, table, seq = bk.paged_pool(lens, page_size, torch.float32, device="cpu")
    pages = sum(math.ceil(n / page_size) for n in lens) + 1
    engine_k, engine_v = layer_view(torch.empty(pages, bk.HKV, 2, 2, page_size, bk.D), 1)
    assert (k_cache.shape, k_cache.stride()) == (engine_k.shape, engine_k.stride())
    assert (v_cache.shape, v_cache.stride()) == (engine_v.shape, engine_v.stride())
    assert v_cache.storage_offset() - k_cache.storage_offset() == page_size * bk.D  # K then V

    # The SDPA baseline's contiguous K/V are the pool's tokens: same attention as the reference.
    ctx = 8  # every sequence holds at least 5; compare over 8 tokens of the two longer ones
    q = torch.randn((2, bk.HQ, bk.D))
    scale = 1 / math.sqrt(bk.D)
    sub = table[1:], torch.full((2,), ctx, dtype=torch.int32)
    want = paged_decode_attention_ref(q, k_cache, v_cache, *sub, scale)
    k, v = bk.dense_kv(k_cache, sub[0], ctx), bk.dense_kv(v_cache, sub[0], ctx)
    got = F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)
    torch.testing.assert_close(got[:, :, 0], want)
    assert seq.tolist() == lens
