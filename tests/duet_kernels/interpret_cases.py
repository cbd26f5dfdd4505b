"""Triton kernels vs their references under the Triton interpreter, on tiny shapes.

Run as a script in a subprocess with TRITON_INTERPRET=1 and DUET_KERNELS=triton (see
test_triton_interpret.py): triton.jit reads TRITON_INTERPRET when a kernel is defined, so the
interpreter must never be switched on inside a shared pytest process. Prints
``{case: max_abs_error}`` as JSON. bfloat16 attention is left to the GPU tests: the interpreter
multiplies bfloat16 dot operands as raw bits (triton-lang/triton#11584).
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Callable

import torch

import duet_kernels
from kvcache.kv_buffer import layer_view
from tests.duet_kernels.paged_inputs import make_paged_kv, pack_queries

CaseFn = Callable[[torch.Generator], float]


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())  # NaN (an unwritten output) propagates


def _decode(
    dtype: torch.dtype,
    head_dim: int,
    page_size: int,
    heads: tuple[int, int],
    window: int | None,
    num_splits: int | None = None,
    softcap: float | None = None,
) -> CaseFn:
    def run(gen: torch.Generator) -> float:
        num_q, num_kv = heads
        kv = make_paged_kv([37, 5, 64, 1], page_size, num_kv, head_dim, dtype, gen)
        q = torch.randn((4, 2 * num_q, head_dim), generator=gen).to(dtype)[:, 1::2]  # strided
        scale = 1 / math.sqrt(head_dim) if softcap is None else 0.5  # large scores: the cap bites
        args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, scale, window, softcap)
        if num_splits is None:
            out = duet_kernels.paged_decode_attention(*args)
        else:  # imported here: the parent pytest process reads CASES without importing triton
            from duet_kernels.decode_attention_triton import DecodeConfig, paged_decode_attention

            config = DecodeConfig(block_n=16, num_stages=1, num_splits=num_splits)
            out = paged_decode_attention(*args, config=config)
        return _err(out, duet_kernels.paged_decode_attention_ref(*args))

    return run


def _prefill(
    dtype: torch.dtype,
    head_dim: int,
    page_size: int,
    heads: tuple[int, int],
    window: int | None,
    softcap: float | None = None,
) -> CaseFn:
    def run(gen: torch.Generator) -> float:
        num_q, num_kv = heads
        # A chunk on top of a cached prefix, an idle sequence, a whole prompt, a single token.
        q_lens, ctx = [5, 0, 33, 1], [37, 20, 33, 50]
        kv = make_paged_kv(ctx, page_size, num_kv, head_dim, dtype, gen)
        q, cu = pack_queries(q_lens, num_q, head_dim, dtype, gen)
        args = (
            q,
            kv.k_cache,
            kv.v_cache,
            kv.page_table,
            cu,
            kv.seq_lens,
            1 / math.sqrt(head_dim) if softcap is None else 0.5,
            window,
            softcap,
        )
        return _err(
            duet_kernels.paged_prefill_attention(*args),
            duet_kernels.paged_prefill_attention_ref(*args),
        )

    return run


def _store_kv(src_dtype: torch.dtype, cache_dtype: torch.dtype) -> CaseFn:
    def run(gen: torch.Generator) -> float:
        kv = make_paged_kv([37, 5], 16, 2, 64, cache_dtype, gen)
        expected = kv.buffer.clone()
        key = torch.randn((6, 4, 64), generator=gen).to(src_dtype)[:, ::2]  # strided heads
        value = torch.randn((6, 2, 64), generator=gen).to(src_dtype)
        slots = torch.tensor([3, -1, 17, 40, -5, 90])
        duet_kernels.store_kv(key, value, kv.k_cache, kv.v_cache, slots)
        duet_kernels.store_kv_ref(key, value, *layer_view(expected, 1), slots)
        return _err(kv.buffer, expected)

    return run


def _page_copy(dtype: torch.dtype, row_elems: int, column_offset: int) -> CaseFn:
    def run(gen: torch.Generator) -> float:
        # column_offset > 0 makes rows start off 4-byte alignment: the non-widened path.
        pool = (torch.randn((12, row_elems + column_offset), generator=gen) * 50).to(dtype)[
            :, column_offset:
        ]
        ids = torch.tensor([5, 2, 11, 7])
        staged = torch.full((4, row_elems), 7, dtype=dtype)
        duet_kernels.gather_pages(pool, ids, staged)
        err = _err(staged, pool[ids])
        dst = torch.zeros((12, row_elems), dtype=dtype)
        duet_kernels.scatter_pages(staged, dst, ids)
        expected = torch.zeros_like(dst)
        expected[ids] = pool[ids]
        copied = torch.zeros((9, row_elems), dtype=dtype)
        duet_kernels.copy_pages(pool, ids, copied, torch.tensor([8, 0, 3, 4]))
        want = torch.zeros_like(copied)
        want[torch.tensor([8, 0, 3, 4])] = pool[ids]
        # Ids outside [first_row, rows) on either side are skipped, as in the reference.
        masked = torch.zeros((9, row_elems), dtype=dtype)
        src_ids, dst_ids = torch.tensor([5, 12, 0, 7, -3]), torch.tensor([1, 2, 3, 9, 4])
        duet_kernels.copy_pages(pool, src_ids, masked, dst_ids, first_row=1)
        want_masked = duet_kernels.copy_pages_ref(
            pool, src_ids, torch.zeros_like(masked), dst_ids, first_row=1
        )
        assert int(want_masked[[2, 3, 4]].count_nonzero()) == 0
        return max(err, _err(dst, expected), _err(copied, want), _err(masked, want_masked))

    return run


def _rms_norm(dtype: torch.dtype, residual: bool, offset: float) -> CaseFn:
    def run(gen: torch.Generator) -> float:
        x = torch.randn((5, 96), generator=gen).to(dtype)
        res = torch.randn((5, 96), generator=gen).to(dtype) if residual else None
        w = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)
        out, s = duet_kernels.add_rms_norm(x, w, 1e-6, res, offset)
        want, want_s = duet_kernels.add_rms_norm_ref(x, w, 1e-6, res, offset)
        return max(_err(out, want), _err(s, want_s))

    return run


def _silu_and_mul(dtype: torch.dtype) -> CaseFn:
    def run(gen: torch.Generator) -> float:
        gate_up = (3 * torch.randn((4, 2 * 1500), generator=gen)).to(dtype)  # crosses a block
        return _err(duet_kernels.silu_and_mul(gate_up), duet_kernels.silu_and_mul_ref(gate_up))

    return run


def _rotary(dtype: torch.dtype) -> CaseFn:
    def run(gen: torch.Generator) -> float:
        from duet_kernels.layer_ops_ref import rotary_cos_sin_cache

        inv_freq = 1.0 / (10000 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))
        cos, sin = rotary_cos_sin_cache(inv_freq, 300, dtype, torch.device("cpu"))
        qkv = torch.randn((6, (5 + 2 + 2) * 32), generator=gen).to(dtype)
        q = qkv[:, : 5 * 32].view(6, 5, 32)  # strided views of one projection, as the model has
        k = qkv[:, 5 * 32 : 7 * 32].view(6, 2, 32)
        positions = torch.tensor([0, 1, 7, 299, 150, 3])
        got = duet_kernels.rotary(q, k, positions, cos, sin)
        want = duet_kernels.rotary_ref(q, k, positions, cos, sin)
        # The model's form: one step's per-token tables, no positions.
        got_t = duet_kernels.rotary(q, k, None, cos[positions], sin[positions])
        errs = [_err(g, w) for g, w in zip(got + got_t, want + want, strict=True)]
        return max(errs)

    return run


# Two fp16 ulps at |out| < 2: kernel and reference round P and the output at different points.
FP16_TOL = 2**-8
# name -> (case, tolerance on the max abs error)
CASES: dict[str, tuple[CaseFn, float]] = {
    "decode_fp32_d64_gqa4_splits": (_decode(torch.float32, 64, 16, (8, 2), None), 1e-5),
    "decode_fp16_d128_mha_window": (_decode(torch.float16, 128, 32, (2, 2), 20), FP16_TOL),
    "decode_fp32_d64_more_splits_than_tiles": (
        _decode(torch.float32, 64, 16, (4, 2), None, 7),
        1e-5,
    ),
    "decode_fp32_d64_single_split": (_decode(torch.float32, 64, 16, (4, 1), 9, 1), 1e-5),
    "prefill_fp32_d64_gqa4_prefix": (_prefill(torch.float32, 64, 16, (8, 2), None), 1e-5),
    "prefill_fp16_d128_gqa2_window": (_prefill(torch.float16, 128, 32, (4, 2), 7), FP16_TOL),
    "prefill_fp32_d64_window_1": (_prefill(torch.float32, 64, 16, (2, 1), 1), 1e-5),
    "decode_fp32_d32_window_softcap": (
        _decode(torch.float32, 32, 8, (4, 2), 11, softcap=3.0),
        1e-5,
    ),
    "decode_fp32_d32_softcap_splits": (
        _decode(torch.float32, 32, 8, (4, 2), None, 3, softcap=2.0),
        1e-5,
    ),
    "prefill_fp32_d32_window_softcap": (
        _prefill(torch.float32, 32, 8, (4, 2), 9, softcap=3.0),
        1e-5,
    ),
    "store_kv_fp16_into_fp16": (_store_kv(torch.float16, torch.float16), 0.0),
    # The interpreter converts float32 -> bfloat16 by truncation where torch rounds to nearest: one
    # bf16 ulp apart (2**-5 for |x| < 8). On the GPU the kernel rounds too (tests/duet_kernels/test_gpu_kernels.py).
    "store_kv_fp32_into_bf16": (_store_kv(torch.float32, torch.bfloat16), 2**-5),
    "page_copy_uint8_widened": (_page_copy(torch.uint8, 4096 * 3 + 16, 0), 0.0),
    "page_copy_uint8_unaligned": (_page_copy(torch.uint8, 37, 1), 0.0),
    "page_copy_fp32": (_page_copy(torch.float32, 300, 0), 0.0),
    "rms_norm_fp32_residual": (_rms_norm(torch.float32, True, 0.0), 1e-5),
    "rms_norm_fp16": (_rms_norm(torch.float16, False, 0.0), FP16_TOL),
    "rms_norm_fp16_residual_gemma": (_rms_norm(torch.float16, True, 1.0), FP16_TOL),
    "silu_and_mul_fp32": (_silu_and_mul(torch.float32), 1e-5),
    "silu_and_mul_fp16": (_silu_and_mul(torch.float16), 2**-6),  # one fp16 ulp at |y| < 16
    "rotary_fp32": (_rotary(torch.float32), 1e-5),
    "rotary_fp16": (_rotary(torch.float16), FP16_TOL),
}


def main() -> None:
    # Without both variables this would compare the reference with itself.
    if os.environ.get("TRITON_INTERPRET") != "1" or not duet_kernels.use_triton(torch.empty(0)):
        raise SystemExit("run with TRITON_INTERPRET=1 and DUET_KERNELS=triton")
    results: dict[str, float] = {}
    for name, (fn, _) in CASES.items():
        results[name] = fn(torch.Generator().manual_seed(zlib.crc32(name.encode())))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
