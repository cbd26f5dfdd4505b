"""Decode step against its memory floor, and offline throughput against HF ``generate`` (GPU).

One process, one random model (HF ``LlamaForCausalLM`` initialised at random, its weights copied
into engine.LLM's model, so both run the same numbers):

1. HBM bandwidth: a device copy of ``--copy-gib`` GiB, bytes read + written over its time.
2. Decode step: ``B`` requests of ``--context`` prompt tokens each (B from ``--batches``) are
   prefilled, then ``--steps`` whole engine steps (schedule, batch, forward, sample, update) are
   timed. The floor of one step is the bytes it must read (every weight but the input embedding,
   the batch's embedding rows, and every cached K/V of the batch) over the copy bandwidth.
   Targets (shared/ANCHORS.md): <= 1.5x the floor at batch 1, <= 1.4x at batch 64.
3. Offline: ``--requests`` requests (prompt lengths uniform in [--min-prompt, --max-prompt],
   exactly ``--output-len`` new tokens, greedy) through engine.LLM and through HF ``generate``
   (batches of ``--hf-batch``, left padding). Target: >= 10x.
4. With ``--ttft-prompts N ...``: the time to the first token of a lone prompt of N random tokens
   (median of 5 after a warm-up), the TTFT the transfer floor's share is taken of
   (docs/benchmarks/transfer.md).

With ``--profile`` it also prints where a decode step's GPU and host time go (torch.profiler).

    python scripts/bench_decode_gpu.py --out out/decode_gpu.json
    python scripts/bench_decode_gpu.py --device cpu --preset tiny --batches 1 4 --requests 8   # smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_offline import hf_generate  # noqa: E402  (this script's folder)

from engine.engine_config import EngineConfig  # noqa: E402
from engine.engine_core import LLMEngine  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.loaders.load import LoadedModel  # noqa: E402
from engine.model import LlamaForCausalLM  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

PRESETS: dict[str, dict[str, Any]] = {
    # Llama-3-8B's shape (what ANCHORS.md's decode targets are stated for)
    "llama-3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
    ),
    # a few MB, for a smoke run of this script on a CPU
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    ),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, gib: float, repeats: int = 10) -> float:
    """Bytes read + written per second by ``dst.copy_(src)`` of ``gib`` GiB (best of repeats)."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t)
    del src, dst
    return 2 * n / best


def random_models(preset: str, dtype: torch.dtype, device: torch.device) -> tuple[Any, LoadedModel]:
    """(HF model, the same weights as our model) at random init."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    hf_config = LlamaConfig(**PRESETS[preset], tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        hf = HFLlama._from_config(hf_config, torch_dtype=dtype).eval()
    config = ModelConfig.from_hf_config(hf_config.to_dict())
    ours = LlamaForCausalLM.build(config, dtype, device)
    with torch.no_grad():
        ours.load_weights((name, p.detach()) for name, p in hf.named_parameters())
    return hf, LoadedModel(config, ours, None, preset)


def weight_bytes_read(model: torch.nn.Module, config: ModelConfig, batch: int) -> int:
    """Bytes of weights one decode step reads: all but the input embedding, plus its batch rows."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.model.embed_tokens.weight
    if not config.tie_word_embeddings:
        total -= emb.numel() * emb.element_size()
    return total + batch * emb.shape[1] * emb.element_size()


def kv_bytes_read(config: ModelConfig, batch: int, context: int, elem: int) -> int:
    return batch * context * config.num_layers * 2 * config.num_kv_heads * config.head_dim * elem


def time_decode(
    loaded: LoadedModel, engine_kwargs: dict[str, Any], batch: int, context: int, steps: int
) -> dict[str, float]:
    """Mean seconds of one engine step with ``batch`` requests decoding at ``context`` tokens."""
    config = EngineConfig(model=loaded.name, **engine_kwargs)
    engine = LLMEngine.from_loaded(loaded, config)
    device = torch.device(config.device)
    gen = torch.Generator().manual_seed(batch)
    vocab = loaded.config.vocab_size
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
        engine.add_request(f"d{i}", prompt, params)
    while engine.scheduler.num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    for _ in range(3):  # warm-up decode steps (first launches, graph replays)
        engine.step()
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    per_step = (time.perf_counter() - t) / steps
    for i in range(batch):
        engine.abort_request(f"d{i}")
    engine.kv.check_integrity()
    return {"step_s": per_step, "context_mid": context + 3 + steps / 2}


def time_ttft(
    loaded: LoadedModel, engine_kwargs: dict[str, Any], prompt_len: int, repeats: int = 5
) -> list[float]:
    """Seconds to the first token of one lone prompt of ``prompt_len`` random tokens, each of
    ``repeats`` prompts after one warm-up (the whole prompt in one step: prefill_chunk_size)."""
    config = EngineConfig(model=loaded.name, **engine_kwargs)
    engine = LLMEngine.from_loaded(loaded, config)
    device = torch.device(config.device)
    gen = torch.Generator().manual_seed(prompt_len)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times = []
    for i in range(repeats + 1):
        prompt = torch.randint(1, loaded.config.vocab_size, (prompt_len,), generator=gen).tolist()
        sync(device)
        t = time.perf_counter()
        engine.add_request(f"t{i}", prompt, params)
        while engine.scheduler.num_waiting or engine.scheduler.num_running:
            engine.step()
        sync(device)
        times.append(time.perf_counter() - t)
    engine.kv.check_integrity()
    return times[1:]


def profile_decode(
    loaded: LoadedModel, engine_kwargs: dict[str, Any], batch: int, context: int
) -> str:
    """torch.profiler table of a few decode steps: kernels by GPU time, and launches per step."""
    from torch.profiler import ProfilerActivity, profile

    config = EngineConfig(model=loaded.name, **engine_kwargs)
    engine = LLMEngine.from_loaded(loaded, config)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(7)
    for i in range(batch):
        engine.add_request(
            f"p{i}",
            torch.randint(0, loaded.config.vocab_size, (context,), generator=gen).tolist(),
            params,
        )
    for _ in range(1000):  # bounded: the prompts' chunks, then decode
        engine.step()
        if not engine.scheduler.num_waiting and all(
            r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running
        ):
            break
    for _ in range(3):
        engine.step()
    steps = 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
    for i in range(batch):
        engine.abort_request(f"p{i}")
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    launches = sum(
        e.count
        for e in prof.key_averages()
        if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch"))
    )
    return f"batch {batch}, {steps} steps, {launches / steps:.0f} launch calls a step\n{table}"


def offline(
    hf: Any, loaded: LoadedModel, engine_kwargs: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    device = torch.device(engine_kwargs["device"])
    gen = torch.Generator().manual_seed(1)
    vocab = loaded.config.vocab_size
    lens = torch.randint(args.min_prompt, args.max_prompt + 1, (args.requests,), generator=gen)
    prompts = [torch.randint(1, vocab, (int(n),), generator=gen).tolist() for n in lens]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    total = args.requests * args.output_len
    llm = LLM.from_loaded(loaded, **engine_kwargs)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    runner = llm.engine.runner
    execute = runner.execute
    step_s = {"decode": 0.0, "prefill": 0.0}  # execute() ends in a host sync (sampled ids)
    step_n = {"decode": 0, "prefill": 0}

    def timed_execute(batch: Any, sampling: Any, *rest: Any) -> list[int]:
        t0 = time.perf_counter()
        out = execute(batch, sampling, *rest)
        kind = "decode" if batch.is_decode_only else "prefill"
        step_s[kind] += time.perf_counter() - t0
        step_n[kind] += 1
        return out

    runner.execute = timed_execute
    sync(device)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync(device)
    t_engine = time.perf_counter() - t
    del llm, runner
    hf_tokens: list[list[int]] = []
    t = time.perf_counter()
    for start in range(0, len(prompts), args.hf_batch):
        batch = prompts[start : start + args.hf_batch]
        hf_tokens.extend(hf_generate(hf, batch, args.output_len, 0, device))
    sync(device)
    t_hf = time.perf_counter() - t
    same = sum(o.token_ids[:8] == h[:8] for o, h in zip(outs, hf_tokens, strict=True))
    return {
        "requests": args.requests,
        "output_tokens": total,
        "engine_s": t_engine,
        "engine_tok_s": total / t_engine,
        # where the engine's time went: steps with prompt tokens, decode-only steps, the rest
        # (scheduling, batch building, detokenizing)
        "engine_prefill_steps": step_n["prefill"],
        "engine_prefill_s": step_s["prefill"],
        "engine_decode_steps": step_n["decode"],
        "engine_decode_s": step_s["decode"],
        "engine_other_s": t_engine - step_s["prefill"] - step_s["decode"],
        "hf_s": t_hf,
        "hf_tok_s": total / t_hf,
        "hf_batch": args.hf_batch,
        "ratio": t_hf / t_engine,
        "first_8_tokens_equal": f"{same}/{args.requests}",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="llama-3-8b", choices=sorted(PRESETS))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--copy-gib", type=float, default=4.0)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--min-prompt", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--hf-batch", type=int, default=64)
    p.add_argument("--no-offline", action="store_true")
    p.add_argument(
        "--ttft-prompts",
        type=int,
        nargs="*",
        default=[],
        help="also time the first token of a lone prompt of each of these lengths",
    )
    p.add_argument("--profile", action="store_true", help="also profile a decode step")
    p.add_argument("--profile-batches", type=int, nargs="*", help="(default: 1 and the largest)")
    p.add_argument(
        "--engine-arg",
        nargs=2,
        action="append",
        default=[],
        metavar=("FIELD", "JSON"),
        help="an EngineConfig field for every engine of this run, e.g. cuda_graphs false",
    )
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    extra = {k: json.loads(v) for k, v in args.engine_arg}
    max_len = max(  # (a TTFT prompt needs room for its first token)
        args.context + args.steps + 16,
        args.max_prompt + args.output_len,
        *(n + 1 for n in args.ttft_prompts),
    )
    engine_kwargs: dict[str, Any] = dict(
        dtype=args.dtype,
        device=args.device,
        max_model_len=max_len,
        max_num_seqs=max(max(args.batches), args.requests),
        max_num_batched_tokens=8192,
        prefill_chunk_size=8192,
        reuse_policy="none",
        **extra,
    )
    if device.type == "cpu":
        engine_kwargs["kv_cache_memory_bytes"] = 256 << 20
    bw = copy_bandwidth(device, args.copy_gib if device.type == "cuda" else 0.25)
    print(f"copy bandwidth (read + written): {bw / 1e9:.0f} GB/s")
    hf, loaded = random_models(args.preset, dtype, device)
    elem = torch.empty((), dtype=dtype).element_size()
    rows = []
    for b in args.batches:
        r = time_decode(loaded, engine_kwargs, b, args.context, args.steps)
        w = weight_bytes_read(loaded.model, loaded.config, b)
        kv = kv_bytes_read(loaded.config, b, int(r["context_mid"]), elem)
        floor = (w + kv) / bw
        row = {
            "batch": b,
            "step_ms": 1e3 * r["step_s"],
            "floor_ms": 1e3 * floor,
            "ratio_to_floor": r["step_s"] / floor,
            "weights_gb": w / 1e9,
            "kv_gb": kv / 1e9,
        }
        rows.append(row)
        print(
            f"batch {b:3d}: step {row['step_ms']:.2f} ms, floor {row['floor_ms']:.2f} ms "
            f"({row['weights_gb']:.2f} GB weights + {row['kv_gb']:.3f} GB KV): "
            f"{row['ratio_to_floor']:.2f}x the floor"
        )
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "preset": args.preset,
        "dtype": args.dtype,
        "context": args.context,
        "copy_bandwidth_gbs": bw / 1e9,
        "decode": rows,
        "engine_args": extra,
    }
    for n in args.ttft_prompts:
        times = sorted(time_ttft(loaded, engine_kwargs, n))
        result.setdefault("ttft_ms", {})[n] = [1e3 * t for t in times]
        print(f"TTFT of a lone {n}-token prompt: median {1e3 * times[len(times) // 2]:.1f} ms")
    if args.profile:
        for b in args.profile_batches or (1, max(args.batches)):
            print(profile_decode(loaded, engine_kwargs, b, args.context))
    if not args.no_offline:
        off = offline(hf, loaded, engine_kwargs, args)
        result["offline"] = off
        print(
            f"offline, {off['requests']} requests: engine {off['engine_tok_s']:.0f} tok/s, "
            f"HF generate (batches of {off['hf_batch']}) {off['hf_tok_s']:.0f} tok/s: "
            f"{off['ratio']:.1f}x; first 8 tokens equal on {off['first_8_tokens_equal']}; "
            f"engine: {off['engine_prefill_steps']} prompt steps {off['engine_prefill_s']:.2f} s, "
            f"{off['engine_decode_steps']} decode steps {off['engine_decode_s']:.2f} s, "
            f"other {off['engine_other_s']:.2f} s"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
