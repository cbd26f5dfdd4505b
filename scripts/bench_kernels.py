"""Benchmark the Triton kernels on a CUDA GPU against same-run baselines; prints a table, writes JSON.

  python scripts/bench_kernels.py --out results.json [--sweep]

- HBM baseline: a large device-to-device copy (bytes read + written over time), this run.
- Decode: batch 64, 4k context, Llama-3-8B shape (32 q / 8 kv heads, head_dim 128), bf16, pages 16
  and 32 in the engine's page layout (heads outermost), shuffled page ids. GB/s = K/V bytes read /
  time; ratios to the copy baseline and to torch SDPA on contiguous K/V (enable_gqa). --sweep also
  times launch configs.
- Prefill: 4 x 4096 whole prompts vs SDPA (is_causal), and 4 x 2048 new tokens over a 2048-token
  prefix vs SDPA with a lower-right causal mask.
- Max abs errors vs the references for bf16 and fp16 at realistic shapes.
- gather/scatter of 4 MiB pages (uint8 view) vs the copy baseline.
Times are medians of triton.testing.do_bench (CUDA events, L2 flushed between runs).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from duet_kernels import (  # noqa: E402
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
)
from duet_kernels.decode_attention_triton import DecodeConfig, paged_decode_attention  # noqa: E402
from duet_kernels.page_copy_triton import gather_pages, scatter_pages  # noqa: E402
from duet_kernels.prefill_attention_triton import PrefillConfig, paged_prefill_attention  # noqa: E402
from kvcache.kv_buffer import layer_view  # noqa: E402

HQ, HKV, D = 32, 8, 128  # Llama-3-8B


def median_ms(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def copy_baseline() -> dict:
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return {"bytes": 2 * src.nbytes, "ms": ms, "gbps": 2 * src.nbytes / ms / 1e6}


def paged_pool(
    seq_lens: list[int],
    page_size: int,
    dtype: torch.dtype,
    num_layers: int = 2,
    device: str = "cuda",
):
    """A pool in the engine's page layout [pages, Hkv, layers, 2, page_size, D]
    (kvcache/spec.py) with shuffled page ids; returns layer 1's K/V views as the engine hands them
    to the kernels (kvcache.kv_buffer.layer_view: strided [pages, page_size, Hkv, D]), the page
    table and the sequence lengths."""
    n_pages = [math.ceil(n / page_size) for n in seq_lens]
    total = sum(n_pages) + 1
    buf = torch.randn((total, HKV, num_layers, 2, page_size, D), device=device, dtype=dtype)
    ids = torch.randperm(total - 1, device=device) + 1
    table = torch.zeros((len(seq_lens), max(n_pages)), dtype=torch.int32, device=device)
    start = 0
    for b, n in enumerate(n_pages):
        table[b, :n] = ids[start : start + n].int()
        start += n
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    k_cache, v_cache = layer_view(buf, 1)
    return k_cache, v_cache, table, lens


def dense_kv(cache: torch.Tensor, table: torch.Tensor, ctx: int) -> torch.Tensor:
    """[B, Hkv, ctx, D] contiguous copy of the first ctx tokens of each sequence (SDPA's input)."""
    b, page_size = table.shape[0], cache.shape[1]
    n = math.ceil(ctx / page_size)
    return (
        cache[table[:, :n].long()]
        .reshape(b, n * page_size, HKV, D)[:, :ctx]
        .transpose(1, 2)
        .contiguous()
    )


def bench_decode(hbm_gbps: float, sweep: bool) -> dict:
    batch, ctx = 64, 4096
    kv_bytes = batch * ctx * HKV * D * 2 * 2  # K and V, bf16
    q = torch.randn((batch, HQ, D), device="cuda", dtype=torch.bfloat16)
    pages = {
        ps: decode_case(q, ctx, ps, kv_bytes, hbm_gbps, sweep=sweep and ps == 16, sdpa=ps == 16)
        for ps in (16, 32)
    }
    # Same bytes, other batch/context splits: checks the split-count heuristic away from batch 64.
    other = {}
    for b, n in ((8, 32768), (256, 1024), (16, 16384)):
        q_other = torch.randn((b, HQ, D), device="cuda", dtype=torch.bfloat16)
        other[f"B{b}_ctx{n}"] = decode_case(
            q_other, n, 16, b * n * HKV * D * 4, hbm_gbps, sweep=False, sdpa=False
        )
    return {"batch": batch, "ctx": ctx, "kv_bytes": kv_bytes, "pages": pages, "other_shapes": other}


def decode_case(
    q: torch.Tensor,
    ctx: int,
    page_size: int,
    kv_bytes: int,
    hbm_gbps: float,
    sweep: bool,
    sdpa: bool,
) -> dict:
    scale = 1 / math.sqrt(D)
    k_cache, v_cache, table, lens = paged_pool([ctx] * q.shape[0], page_size, torch.bfloat16)
    args = (q, k_cache, v_cache, table, lens, scale)
    ms = median_ms(lambda: paged_decode_attention(*args))
    entry = {"ms": ms, "gbps": kv_bytes / ms / 1e6, "ratio_to_copy": kv_bytes / ms / 1e6 / hbm_gbps}
    if sweep:
        entry["sweep"] = sweep_decode(args, kv_bytes)
    if sdpa:
        k, v = dense_kv(k_cache, table, ctx), dense_kv(v_cache, table, ctx)
        q4 = q[:, :, None, :]  # [B, Hq, 1, D]
        try:
            sdpa_ms = median_ms(
                lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)
            )
            entry.update(
                sdpa_ms=sdpa_ms, sdpa_gbps=kv_bytes / sdpa_ms / 1e6, speedup_vs_sdpa=sdpa_ms / ms
            )
        except Exception as exc:  # no SDPA backend for this case: say so
            entry["sdpa_error"] = repr(exc)[:200]
    return entry


def sweep_decode(args: tuple, kv_bytes: int) -> list[dict]:
    rows = []
    # Variants around the default (block_n 64, 4 warps, 3 stages); prefetching the next tile into
    # registers and 8 warps were slower on an H200 (docs/benchmarks/kernels.md).
    for block_n, warps, stages in ((64, 4, 3), (64, 4, 2), (128, 4, 2), (32, 4, 2)):
        for splits in (None, 2, 3, 4, 8):
            cfg = DecodeConfig(
                block_n=block_n, num_warps=warps, num_stages=stages, num_splits=splits
            )
            try:
                ms = median_ms(lambda cfg=cfg: paged_decode_attention(*args, config=cfg))
            except Exception as exc:  # e.g. out of shared memory: record and go on
                rows.append({"config": repr(cfg), "error": repr(exc)[:200]})
                continue
            rows.append({"config": repr(cfg), "ms": ms, "gbps": kv_bytes / ms / 1e6})
    return sorted(rows, key=lambda r: r.get("ms", float("inf")))


def causal_flops(q_lens: list[int], ctx: list[int]) -> float:
    pairs = sum(q * c - q * (q - 1) / 2 for q, c in zip(q_lens, ctx, strict=True))
    return 4.0 * HQ * D * pairs


def bench_prefill(sweep: bool) -> dict:
    return {
        "prompt_4x4096": prefill_case(q_len=4096, prefix=0, sweep=sweep),
        "chunk_4x2048_on_2048": prefill_case(q_len=2048, prefix=2048),
    }


def prefill_case(q_len: int, prefix: int, batch: int = 4, sweep: bool = False) -> dict:
    from torch.nn.attention.bias import causal_lower_right

    scale = 1 / math.sqrt(D)
    ctx = q_len + prefix
    k_cache, v_cache, table, lens = paged_pool([ctx] * batch, 16, torch.bfloat16)
    q = torch.randn((batch * q_len, HQ, D), device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * q_len
    ms = median_ms(lambda: paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, scale))
    flops = causal_flops([q_len] * batch, [ctx] * batch)
    entry = {"ms": ms, "tflops": flops / ms / 1e9}
    if sweep:
        entry["sweep"] = []
        for shape in ((128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 4, 3)):
            cfg = PrefillConfig(*shape)
            try:
                cfg_ms = median_ms(
                    lambda cfg=cfg: paged_prefill_attention(
                        q, k_cache, v_cache, table, cu, lens, scale, config=cfg
                    )
                )
                entry["sweep"].append(
                    {"config": repr(cfg), "ms": cfg_ms, "tflops": flops / cfg_ms / 1e9}
                )
            except Exception as exc:  # e.g. out of shared memory
                entry["sweep"].append({"config": repr(cfg), "error": repr(exc)[:200]})
    k, v = dense_kv(k_cache, table, ctx), dense_kv(v_cache, table, ctx)
    q4 = q.view(batch, q_len, HQ, D).transpose(1, 2)
    mask = causal_lower_right(q_len, ctx) if prefix else None
    try:
        sdpa_ms = median_ms(
            lambda: F.scaled_dot_product_attention(
                q4, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
            )
        )
        entry.update(
            sdpa_ms=sdpa_ms, sdpa_tflops=flops / sdpa_ms / 1e9, speedup_vs_sdpa=sdpa_ms / ms
        )
    except Exception as exc:  # a backend may lack GQA + lower-right masks: say so
        entry["sdpa_error"] = repr(exc)[:200]
    return entry


def errors() -> dict:
    gen = torch.Generator(device="cpu").manual_seed(0)
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        lens = torch.randint(1, 4097, (16,), generator=gen).tolist()
        k_cache, v_cache, table, seq = paged_pool(lens, 16, dtype)
        q = torch.randn((16, HQ, D), device="cuda", dtype=dtype)
        args = (q, k_cache, v_cache, table, seq, 1 / math.sqrt(D))
        err = (
            (paged_decode_attention(*args).float() - paged_decode_attention_ref(*args).float())
            .abs()
            .max()
        )
        out[f"decode_{name}"] = float(err)
        q_lens = [1000, 1, 517, 2048]
        ctx = [q + p for q, p in zip(q_lens, [0, 3000, 1500, 2048], strict=True)]
        k_cache, v_cache, table, seq = paged_pool(ctx, 16, dtype)
        qp = torch.randn((sum(q_lens), HQ, D), device="cuda", dtype=dtype)
        cu = torch.tensor(
            [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda"
        )
        args = (qp, k_cache, v_cache, table, cu, seq, 1 / math.sqrt(D))
        err = (
            (paged_prefill_attention(*args).float() - paged_prefill_attention_ref(*args).float())
            .abs()
            .max()
        )
        out[f"prefill_{name}"] = float(err)
    return out


def bench_page_copy(hbm_gbps: float) -> dict:
    page_bytes, n_pool, n = 4 << 20, 600, 256  # 4 MiB: one Llama-3-8B page of 16 tokens, 32 layers
    pool = torch.randint(0, 256, (n_pool, page_bytes), dtype=torch.uint8, device="cuda")
    ids = torch.randperm(n_pool, device="cuda")[:n]
    staged = torch.empty((n, page_bytes), dtype=torch.uint8, device="cuda")
    moved = 2 * n * page_bytes
    result = {}
    for name, fn in (
        ("gather", lambda: gather_pages(pool, ids, staged)),
        ("scatter", lambda: scatter_pages(staged, pool, ids)),
        ("index_select_ref", lambda: torch.index_select(pool, 0, ids, out=staged)),
    ):
        ms = median_ms(fn)
        result[name] = {
            "ms": ms,
            "gbps": moved / ms / 1e6,
            "ratio_to_copy": moved / ms / 1e6 / hbm_gbps,
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sweep", action="store_true", help="also time decode launch configs")
    opts = parser.parse_args()
    torch.manual_seed(0)
    results: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    results["hbm_copy"] = copy_baseline()
    hbm = results["hbm_copy"]["gbps"]
    sections = (
        ("decode", lambda: bench_decode(hbm, opts.sweep)),
        ("prefill", lambda: bench_prefill(opts.sweep)),
        ("max_abs_error", errors),
        ("page_copy", lambda: bench_page_copy(hbm)),
    )
    for name, run in sections:
        results[name] = run()
        opts.out.write_text(json.dumps(results, indent=2))  # after each section: partial runs count
        torch.cuda.empty_cache()

    print(f"\n{results['device']}  torch {results['torch']}  triton {results['triton']}")
    print(f"HBM copy baseline: {hbm:8.0f} GB/s")
    for page_size, e in results["decode"]["pages"].items():
        extra = (
            f"  SDPA {e['sdpa_gbps']:6.0f} GB/s  x{e['speedup_vs_sdpa']:.2f}"
            if "sdpa_ms" in e
            else ""
        )
        print(
            f"decode B64 ctx4k page {page_size:2d}: {e['ms'] * 1e3:7.1f} us {e['gbps']:6.0f} GB/s  "
            f"{100 * e['ratio_to_copy']:5.1f}% of copy{extra}"
        )
    for name, e in results["decode"]["other_shapes"].items():
        print(
            f"decode {name:17s}: {e['ms'] * 1e3:7.1f} us {e['gbps']:6.0f} GB/s  {100 * e['ratio_to_copy']:5.1f}% of copy"
        )
    for name, e in results["prefill"].items():
        extra = (
            f"  SDPA {e['sdpa_tflops']:5.0f} TFLOP/s  x{e['speedup_vs_sdpa']:.2f}"
            if "sdpa_ms" in e
            else f"  {e.get('sdpa_error', '')}"
        )
        print(f"prefill {name:22s}: {e['ms']:7.3f} ms {e['tflops']:5.0f} TFLOP/s{extra}")
    for name, e in results["page_copy"].items():
        print(
            f"page copy {name:16s}: {e['gbps']:6.0f} GB/s  {100 * e['ratio_to_copy']:5.1f}% of copy"
        )
    for name, err in results["max_abs_error"].items():
        print(f"max abs error {name:16s}: {err:.3e}")
    for row in results["decode"]["pages"][16].get("sweep", [])[:8]:
        print(f"decode sweep {row.get('gbps', 0):6.0f} GB/s  {row['config']}")
    for row in results["prefill"]["prompt_4x4096"].get("sweep", []):
        print(f"prefill sweep {row.get('tflops', 0):5.0f} TFLOP/s  {row['config']}")


if __name__ == "__main__":
    main()
