"""The linear-layer floor of the CPU offline workload, against HF transformers' whole batched
``generate`` on the same workload, same process, same threads, interleaved.

    .venv/bin/python scripts/bench_linear_floor.py [--threads 2] [--repeats 3] [--out FILE.json]

The workload is bench_vs_vllm_cpu.py's offline one: 32 prompts of exactly 128 tokens, 64 new tokens
each, greedy, the embedded SmolLM2-135M in float32. Any engine that runs this model exactly (float32,
the same greedy tokens as transformers) performs every matrix product of the decoder's linear
layers: per layer the q/k/v, output, gate/up and down projections of every prompt token and every
decoded token, and the LM head for each sampled row. This script times those products alone, at the
row counts an engine with Duet's default scheduler (2048 batched tokens a step) runs them, through
each linear implementation torch offers on CPU (MKL's sgemm behind ``F.linear``, and oneDNN with a
prepacked weight, which Duet runs: kernels/linear_cpu.py) and keeps the faster one per shape.
Nothing else is counted: no attention, norms, activations, sampling or Python.

That sum is a floor under any such engine's time on this machine with these libraries, so
``HF seconds / floor`` is the most any of them can be ahead of HF here: a ratio target above it
(issue 28's ">= 2x HF") needs matrix products faster than both libraries, not a faster engine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_offline import hf_generate  # noqa: E402

from engine.loaders import default_gguf_path, load_model  # noqa: E402
from kernels.linear_cpu import linear_cpu, pack_weight  # noqa: E402


def step_rows(requests: int, prompt: int, new: int, batched: int) -> list[tuple[int, int]]:
    """(token rows, LM-head rows) of each engine step: prefill in steps of ``batched`` tokens
    (whole prompts), each finished prompt sampling one row, then ``new - 1`` decode steps."""
    per_step = max(1, batched // prompt)
    steps = []
    left = requests
    while left:
        n = min(per_step, left)
        steps.append((n * prompt, n))
        left -= n
    steps += [(requests, requests)] * (new - 1)
    return steps


def time_product(rows: int, weight: torch.Tensor, packed: torch.Tensor) -> dict[str, float]:
    """Seconds per call of ``x @ weight.T`` for ``rows`` rows: the median of 5 rounds of calls,
    each round at least 0.1 s, per implementation."""
    x = torch.randn(rows, weight.shape[1])
    out = {}
    for name, fn in (
        ("mkl", lambda: F.linear(x, weight)),
        ("onednn", lambda: linear_cpu(x, packed)),
    ):
        for _ in range(3):
            fn()
        rounds = []
        for _ in range(5):
            calls, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < 0.1:
                fn()
                calls += 1
            rounds.append(elapsed / calls)
        out[name] = sorted(rounds)[2]
    return out


def linear_floor(config, steps: list[tuple[int, int]]) -> dict[str, float]:
    """Seconds of the workload's linear products, per implementation and the faster per shape."""
    h, d = config.hidden_size, config.head_dim
    weights = {  # (out, in) of each product of one layer
        "qkv": ((config.num_heads + 2 * config.num_kv_heads) * d, h),
        "o": (h, config.num_heads * d),
        "gate_up": (2 * config.intermediate_size, h),
        "down": (h, config.intermediate_size),
    }
    lm_head = (config.vocab_size, h)
    cache: dict[tuple[int, tuple[int, int]], dict[str, float]] = {}
    tensors: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def cost(rows: int, shape: tuple[int, int]) -> dict[str, float]:
        if (rows, shape) not in cache:
            if shape not in tensors:
                w = torch.randn(shape) * 0.02
                tensors[shape] = (w, pack_weight(w))
            cache[rows, shape] = time_product(rows, *tensors[shape])
        return cache[rows, shape]

    total = {"mkl": 0.0, "onednn": 0.0, "best": 0.0}
    for tokens, sampled in steps:
        parts = [cost(tokens, s) for s in weights.values()] * config.num_layers
        parts.append(cost(sampled, lm_head))
        for p in parts:
            total["mkl"] += p["mkl"]
            total["onednn"] += p["onednn"]
            total["best"] += min(p.values())
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batched-tokens", type=int, default=2048, help="an engine step's tokens")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds of both")
    parser.add_argument("--out", type=Path, help="write the run as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    gguf = default_gguf_path()
    config = load_model("default").config
    hf = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    gen = torch.Generator().manual_seed(0)
    vocab = config.vocab_size
    prompts = torch.randint(100, vocab, (args.num_requests, args.prompt_tokens), generator=gen)
    steps = step_rows(args.num_requests, args.prompt_tokens, args.max_tokens, args.batched_tokens)
    hf_generate(hf, prompts[:2, :8].tolist(), 2, 0)  # (warm-up)
    rounds = []
    for i in range(args.repeats):
        start = time.perf_counter()
        hf_generate(hf, prompts.tolist(), args.max_tokens, 0)
        hf_s = time.perf_counter() - start
        floor = linear_floor(config, steps)
        rounds.append({"hf_s": hf_s, **{f"floor_{k}_s": v for k, v in floor.items()}})
        print(
            f"[{i}] HF generate {hf_s:.2f} s | linear products alone: MKL {floor['mkl']:.2f} s, "
            f"oneDNN packed {floor['onednn']:.2f} s, faster per shape {floor['best']:.2f} s | "
            f"most any engine can be ahead of HF: {hf_s / floor['best']:.2f}x"
        )
    best = sorted(r["hf_s"] / r["floor_best_s"] for r in rounds)
    print(f"HF / linear floor over {len(rounds)} rounds: {', '.join(f'{b:.2f}' for b in best)}")
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "cpu": platform.processor() or platform.machine(),
                    "threads": args.threads,
                    "torch": torch.__version__,
                    "workload": vars(args) | {"out": str(args.out)},
                    "steps": len(steps),
                    "rounds": rounds,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
