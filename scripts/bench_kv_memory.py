"""KV memory of one request of a Gemma-3-shaped model: full attention only vs hybrid pool groups
(sliding-window scratch reuse off and on), counted by running the real KVCacheManager.

For each context length N the request's prompt (N - 1 tokens) is prefilled in chunks through the
manager (allocate, commit after every chunk as ``all_reusable`` does), then one decode step takes it
to N tokens. Reported per case: the bytes the request holds then (its pages x the shape's page
bytes), the peak it held during the prefill, and the pool footprint it leaves (held + the cached
pages it released into the pool), next to the arithmetic of the shape. No model runs: pages are
counted on pools whose storage is one float per slot (the accounting does not depend on it), and
bytes come from the real shape's page size.

    .venv/bin/python scripts/bench_kv_memory.py --out docs/benchmarks/kv_memory.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.kv_setup import kv_pool_templates  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from kvcache.manager import KVCacheManager  # noqa: E402
from kvcache.sizing import pages_per_request  # noqa: E402
from kvcache.sliding_window import max_pages_held  # noqa: E402
from kvcache.spec import PoolGroupSpec  # noqa: E402

# google/gemma-3-12b-it's text model: 48 layers (5 sliding : 1 full), 8 kv heads of 256, window 1024.
GEMMA3_12B = ModelConfig.from_hf_config(
    {
        "model_type": "gemma3_text",
        "vocab_size": 262208,
        "hidden_size": 3840,
        "intermediate_size": 15360,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256,
        "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
)
DTYPE = torch.bfloat16


def count_only(spec: PoolGroupSpec, num_pages: int) -> PoolGroupSpec:
    """The same group with one layer of one float per slot: same page ids, tiny storage."""
    return dataclasses.replace(
        spec, layer_ids=spec.layer_ids[:1], num_pages=num_pages, num_kv_heads=1, head_dim=1,
        dtype=torch.float32,
    )  # fmt: skip


def run_request(
    templates: list[PoolGroupSpec], tokens: int, chunk: int, page_size: int, scratch: bool
) -> dict[str, dict[str, int]]:
    """Pages per group of one request of ``tokens`` tokens: held after its first decode step,
    peak held during its prefill, and the footprint (held + cached) it leaves."""
    pages = -(-tokens // page_size) + 2
    specs = [count_only(t, pages + 1) for t in templates]
    kv = KVCacheManager(specs, "all_reusable", "cpu", swa_scratch_reuse=scratch)
    prompt = list(range(tokens - 1))
    done = 0
    while done < len(prompt):
        end = min(len(prompt), done + chunk)
        assert kv.allocate_slots("r", end, num_computed_tokens=done)
        done = end
        kv.commit("r", prompt, done, prompt_done=done == len(prompt))
    prefill = kv.stats().groups
    assert kv.allocate_slots("r", tokens, num_computed_tokens=done)  # the first decode step
    held = {g: sum(p != 0 for p in ids) for g, ids in kv.page_ids("r").items()}
    kv.check_integrity()
    out = {}
    for g, s in kv.stats().groups.items():
        out[g] = {
            "held": held[g],
            "prefill_peak_held": prefill[g].peak_used,
            "prefill_peak_footprint": s.total - s.free_low_water,
            "footprint": s.used + s.evictable,
        }
    return out


def arithmetic(templates: list[PoolGroupSpec], tokens: int, chunk: int) -> dict[str, int]:
    """Pages the shape says: the whole context in full groups, the window (at the worst offset)
    plus the page being written in window groups; during prefill the window plus a chunk."""
    ps = templates[0].page_size
    return {t.name: max_pages_held(tokens, ps, t.sliding_window, 1) for t in templates} | {
        f"{t.name}_prefill": max_pages_held(tokens, ps, t.sliding_window, chunk) for t in templates
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args()
    ps, chunk = args.page_size, args.chunk
    hybrid = kv_pool_templates(GEMMA3_12B, ps, DTYPE)
    no_window = dataclasses.replace(GEMMA3_12B, layer_types=(), sliding_window=None)
    full_only = kv_pool_templates(no_window, ps, DTYPE)
    cases = {
        "full only": (full_only, False),
        "hybrid": (hybrid, False),
        "hybrid + scratch": (hybrid, True),
    }
    rows = []
    for tokens in args.tokens:
        for case, (templates, scratch) in cases.items():
            counted = run_request(templates, tokens, chunk, ps, scratch)
            page_bytes = {t.name: t.page_bytes for t in templates}

            def total(key: str, counted=counted, page_bytes=page_bytes) -> int:
                return sum(counted[g][key] * page_bytes[g] for g in counted)

            expect = arithmetic(templates, tokens, chunk)
            rows.append(
                {
                    "tokens": tokens,
                    "case": case,
                    "pages": counted,
                    "arithmetic_pages": expect,
                    "held_bytes": total("held"),
                    "arithmetic_held_bytes": sum(expect[g] * page_bytes[g] for g in page_bytes),
                    "prefill_peak_held_bytes": total("prefill_peak_held"),
                    "prefill_peak_footprint_bytes": total("prefill_peak_footprint"),
                    "footprint_bytes": total("footprint"),
                }
            )
    full_held = {r["tokens"]: r["held_bytes"] for r in rows if r["case"] == "full only"}
    for r in rows:
        r["held_vs_full_only"] = round(r["held_bytes"] / full_held[r["tokens"]], 4)
    mib = 1 << 20
    print(f"Gemma-3-12B shape, bf16, page {ps} tokens, prefill chunk {chunk}")
    print("| tokens | case | held (MiB) | arithmetic (MiB) | vs full only | prefill peak held (MiB) "
          "| prefill peak footprint (MiB) | footprint left (MiB) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['tokens']} | {r['case']} | {r['held_bytes'] / mib:.1f} | "
            f"{r['arithmetic_held_bytes'] / mib:.1f} | {r['held_vs_full_only']:.3f} | "
            f"{r['prefill_peak_held_bytes'] / mib:.1f} | "
            f"{r['prefill_peak_footprint_bytes'] / mib:.1f} | {r['footprint_bytes'] / mib:.1f} |"
        )
    window = next(t for t in hybrid if t.sliding_window is not None)
    longest = max(args.tokens)
    need = pages_per_request(hybrid, longest, chunk)[window.name]
    print(
        f"\nWindow group {window.name} during one {longest}-token prefill (pages; the arithmetic: "
        f"ceil((window + chunk - 2) / page) + 1 = {need} held at most, {-(-longest // ps)} in "
        "the prompt)"
    )
    print("| case | held after | prefill peak held | prefill peak footprint | footprint left |")
    print("|---|---|---|---|---|")
    for r in rows:
        if r["tokens"] == longest and r["case"] != "full only":
            w = r["pages"][window.name]
            print(
                f"| {r['case']} | {w['held']} | {w['prefill_peak_held']} | "
                f"{w['prefill_peak_footprint']} | {w['footprint']} |"
            )
    if args.out:
        result = {
            "shape": "gemma-3-12b text (48 layers, 40 sliding, window 1024, 8 kv heads x 256, bf16)",
            "page_size": ps,
            "chunk": chunk,
            "page_bytes": {t.name: t.page_bytes for t in hybrid + full_only},
            "rows": rows,
        }
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
