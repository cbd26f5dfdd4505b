"""The linear-layer floor of the CPU offline workload, against HF transformers' whole batched
``generate`` on the same workload, same process, same threads, interleaved.

    .venv/bin/python scripts/bench_linear_floor.py [--threads 2] [--repeats 3] [--out FILE.json]

The workload is bench_vs_vllm_cpu.py's offline one: 32 prompts of exactly 128 tokens, 64 new tokens
each, greedy, the embedded SmolLM2-135M in float32. Any engine that runs this model exactly (float32,
the same greedy tokens as transformers) performs every matrix product of the decoder's linear
layers: per layer the q/k/v, output, gate/up and down projections of every prompt token and every
decoded token, and the LM head for each sampled row. This script times those products alone, at the
row counts an engine with Duet's default scheduler (2048 batched tokens a step) runs them, each
step through every layer's own weights (read from memory each step, as in an engine, not from a
cache), through each linear implementation torch offers on CPU
(MKL's sgemm behind ``F.linear``, and oneDNN with a prepacked weight, which Duet runs:
duet_kernels/linear_cpu.py), and keeps the faster one per step. Nothing else is counted: no attention,
norms, activations, sampling or Python.

That sum is a floor under the time of any such engine that steps as Duet does (the prefill part
depends on its 2048-token steps; the decode part holds for any engine, which runs every request's
rows each step), on this machine with these libraries, so ``HF seconds / floor`` is the most such
an engine can be ahead of HF here: a ratio target above it (issue 28's ">= 2x HF") needs matrix
products faster than both libraries, not a faster engine.

With the KV reads: each decode step's attention must also read every key and value of every
request's context in every layer (SmolLM2 has no sliding window; its float32 KV is 46 KiB a token,
about 240 MB a step here). The script times the same decode step again with, after each layer's
products, one streaming read (a sum) of that layer's keys and values at the step's mean context,
from a cache as large as the workload's: the weights and the KV then compete for the caches and
the memory bus as they do in an engine. Prefill's reads (a prompt's own few MB) are left out, so
"linear + KV" is still a floor.

The script also prints the compute floor, which no library or step size can beat: the workload's
floating-point operations in those products, at the highest rate any of its steps reached (the
2048-row prefill steps, where both libraries run near this CPU's peak of two 256-bit FMA units
per core).
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

from duet_kernels.linear_cpu import linear_cpu, pack_weight  # noqa: E402
from engine.loaders import default_gguf_path, load_model  # noqa: E402


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


def time_step(fn, calls: int) -> float:
    """Median seconds of ``calls`` calls of ``fn`` (after one warm-up call)."""
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


class Layers:
    """The model's linear weights, each layer its own (random: only the shapes matter), as a
    dense float32 tensor (``F.linear``: MKL) and packed for oneDNN (duet_kernels/linear_cpu.py). Every
    weight is read from memory at every step as in an engine: 538 MB in float32 for SmolLM2-135M,
    far beyond any cache."""

    def __init__(self, config) -> None:
        h, d = config.hidden_size, config.head_dim
        shapes = [  # (out, in) of each product of one layer
            ((config.num_heads + 2 * config.num_kv_heads) * d, h),  # q, k, v
            (h, config.num_heads * d),  # o
            (2 * config.intermediate_size, h),  # gate, up
            (h, config.intermediate_size),  # down
        ]
        self.dense = [
            [torch.randn(shape) * 0.02 for shape in shapes] for _ in range(config.num_layers)
        ]
        self.lm_head = torch.randn((config.vocab_size, h)) * 0.02
        self.packed = [[pack_weight(w) for w in layer] for layer in self.dense]
        self.lm_head_packed = pack_weight(self.lm_head)
        # keys and values of one token in one layer, in floats
        self.kv_token_floats = 2 * config.num_kv_heads * d
        self.kv: torch.Tensor | None = None

    def make_kv(self, tokens: int) -> None:
        """Every layer's KV cache for ``tokens`` tokens in all (random: only the bytes matter)."""
        self.kv = torch.rand(len(self.dense), tokens * self.kv_token_floats)

    def step(self, rows: int, sampled: int, which: str, kv_tokens: int = 0) -> float:
        """Seconds of one step's products: ``rows`` token rows through every layer's products
        (each product's input a fresh activation of its width), ``sampled`` rows through the LM
        head; with ``kv_tokens``, each layer also reads that many tokens' keys and values."""
        if which == "mkl":
            layers, head, linear = self.dense, self.lm_head, F.linear
        else:
            layers, head, linear = self.packed, self.lm_head_packed, linear_cpu
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in self.dense[0]}
        last = torch.randn(sampled, self.lm_head.shape[1])
        assert not kv_tokens or self.kv is not None
        kv = self.kv[:, : kv_tokens * self.kv_token_floats] if kv_tokens else None

        def run() -> None:
            for i, (dense, weights) in enumerate(zip(self.dense, layers, strict=True)):
                for w, packed in zip(dense, weights, strict=True):
                    linear(inputs[w.shape[1]], packed)
                if kv is not None:
                    kv[i].sum()
            linear(last, head)

        return time_step(run, 3 if rows > 256 else 7)


def linear_floor(
    layers: Layers, steps: list[tuple[int, int]], per_step: dict[str, dict[str, float]]
) -> dict[str, float]:
    """Seconds of the workload's linear products, per implementation and the faster per step
    (and each kind of step's seconds into ``per_step``, keyed "rows x sampled")."""
    total = {"mkl": 0.0, "onednn": 0.0, "best": 0.0}
    for shape in sorted(set(steps)):
        times = {which: layers.step(*shape, which) for which in ("mkl", "onednn")}
        per_step[f"{shape[0]} x {shape[1]}"] = times
        count = steps.count(shape)
        for which, t in times.items():
            total[which] += count * t
        total["best"] += count * min(times.values())
    return total


def kv_floor(
    layers: Layers,
    steps: list[tuple[int, int]],
    requests: int,
    prompt: int,
    per_step: dict[str, dict[str, float]],
) -> tuple[float, dict[str, float | str]]:
    """Seconds the decode steps' KV reads add to their products (the faster implementation's):
    one decode step timed with each layer's reads at the decode steps' mean context, times their
    number (the bytes grow linearly with the context); and that step's figures."""
    decode = [s for s in steps if s == (requests, requests)]
    if not decode:
        return 0.0, {}
    mean_context = prompt + (len(decode) + 1) / 2  # (contexts prompt + 1 .. prompt + len)
    which = min(per_step[f"{requests} x {requests}"].items(), key=lambda kv: kv[1])[0]
    alone = layers.step(requests, requests, which)
    with_kv = layers.step(requests, requests, which, round(requests * mean_context))
    step = {"impl": which, "mean_context": mean_context, "alone_s": alone, "with_kv_s": with_kv}
    return len(decode) * max(0.0, with_kv - alone), step


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
    layers = Layers(config)
    layers.make_kv(args.num_requests * (args.prompt_tokens + args.max_tokens))
    hf_generate(hf, prompts[:2, :8].tolist(), 2, 0)  # (warm-up)
    rounds = []
    for i in range(args.repeats):
        start = time.perf_counter()
        hf_generate(hf, prompts.tolist(), args.max_tokens, 0)
        hf_s = time.perf_counter() - start
        per_step: dict[str, dict[str, float]] = {}
        floor = linear_floor(layers, steps, per_step)
        kv, kv_step = kv_floor(layers, steps, args.num_requests, args.prompt_tokens, per_step)
        with_kv = floor["best"] + kv
        rounds.append(
            {
                "hf_s": hf_s,
                **{f"floor_{k}_s": v for k, v in floor.items()},
                "kv_reads_s": kv,
                "floor_with_kv_s": with_kv,
                "decode_step_kv": kv_step,
                "steps_s": per_step,
            }
        )
        print(
            f"[{i}] HF generate {hf_s:.2f} s | linear products alone: MKL {floor['mkl']:.2f} s, "
            f"oneDNN packed {floor['onednn']:.2f} s, faster per step {floor['best']:.2f} s | "
            f"most any engine can be ahead of HF: {hf_s / floor['best']:.2f}x | with the decode "
            f"steps' KV reads (+{kv:.2f} s): {with_kv:.2f} s, {hf_s / with_kv:.2f}x"
        )
    layer_params = sum(w.numel() for layer in layers.dense for w in layer)
    weight_bytes = 4 * (layer_params + layers.lm_head.numel())
    for name, times in rounds[-1]["steps_s"].items():
        rows, sampled = (int(x) for x in name.split(" x "))
        t = min(times.values())
        flops = 2 * (rows * layer_params + sampled * layers.lm_head.numel())
        print(
            f"a step of {rows} token rows, {sampled} sampled: {1e3 * t:.1f} ms, weights read at "
            f"{weight_bytes / t / 1e9:.1f} GB/s, {flops / t / 1e9:.0f} GFLOP/s (last round)"
        )
    total_flops = sum(
        2 * (rows * layer_params + sampled * layers.lm_head.numel()) for rows, sampled in steps
    )
    peak = max(
        2 * (rows * layer_params + sampled * layers.lm_head.numel()) / min(t.values())
        for r in rounds
        for name, t in r["steps_s"].items()
        for rows, sampled in [(int(x) for x in name.split(" x "))]
    )
    compute_s = total_flops / peak
    hf_best = min(r["hf_s"] for r in rounds)
    print(
        f"compute floor: {total_flops / 1e12:.2f} TFLOP of products at the best step rate "
        f"({peak / 1e9:.0f} GFLOP/s) = {compute_s:.2f} s; HF's fastest round / that: "
        f"{hf_best / compute_s:.2f}x"
    )
    best = sorted(r["hf_s"] / r["floor_best_s"] for r in rounds)
    print(f"HF / linear floor over {len(rounds)} rounds: {', '.join(f'{b:.2f}' for b in best)}")
    kv_best = sorted(r["hf_s"] / r["floor_with_kv_s"] for r in rounds)
    print(f"HF / (linear + KV reads) floor: {', '.join(f'{b:.2f}' for b in kv_best)}")
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
                    "weight_bytes": weight_bytes,
                    "kv_bytes": layers.kv.numel() * 4 if layers.kv is not None else 0,
                    "flops": total_flops,
                    "best_step_flops_per_s": peak,
                    "compute_floor_s": compute_s,
                    "rounds": rounds,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
