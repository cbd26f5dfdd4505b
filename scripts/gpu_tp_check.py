"""GPU check of tensor parallelism (scripts/gpu_check.sh's ``tp`` step, on a host of 4 GPUs).

1. configs/gpu_tp.yaml validates, and its tensor_parallel_size splits its model (cluster/preflight).
2. Offline, NCCL: ``engine.LLM`` on the Llama-3-8B shape (random weights, float32 so that the
   reduction order of the all-reduce is the only difference) at tp 1 and tp 2: how many greedy
   tokens agree (random weights give small logit margins: a late flip is reported, not hidden).
3. Offline decode TPOT at tp 1 against tp 2 (bfloat16, 16 requests, 64 new tokens), interleaved
   repetitions in rotating order, each figure with its same-run tp 1 baseline.
4. The clusters: configs/gpu_tp.yaml (prefill tp 2 on GPUs 0-1, decode tp 2 on GPUs 2-3, the
   70B shape) and a prefill tp 2 / decode tp 1 cluster of the 8B shape, each against its
   aggregated tp 1 twin's greedy tokens where that fits one GPU (the 8B one), with the transfer
   figures from /perf_metrics.

``--dry-run`` (what runs on CPU) does step 1 only. Prints one JSON document at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# NVLink multicast stays off on shared GPU hosts (it can take the host's GPUs out of service);
# every rank process inherits these.
for _name, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_name, _value)

from cluster.config import ConfigError, config_from_dict, load_config  # noqa: E402
from cluster.preflight import tensor_parallel_issues  # noqa: E402
from engine.loaders import read_model_config  # noqa: E402

CONFIG = REPO / "configs" / "gpu_tp.yaml"


def validate() -> dict[str, Any]:
    config = load_config(CONFIG)
    dummy = config.model.dummy_config
    model = read_model_config(
        config.model.source, config.model.load_format, dummy.as_hf_dict() if dummy else None
    )
    issues = tensor_parallel_issues(config, model)
    if issues:
        raise ConfigError(str(CONFIG), issues)
    return {
        "config": str(CONFIG.relative_to(REPO)),
        "prefill_tp": config.prefill.tensor_parallel_size,
        "decode_tp": config.decode.tensor_parallel_size,
        "model": {
            "heads": model.num_heads,
            "kv_heads": model.num_kv_heads,
            "layers": model.num_layers,
        },
    }


def _llm(tp: int, dtype: str) -> Any:
    from engine.llm import LLM

    return LLM(
        "llama-3-8b",
        load_format="dummy",
        dtype=dtype,
        device="cuda",
        tensor_parallel_size=tp,
        kv_cache_memory_bytes=8 << 30,
        max_model_len=2048,
        cuda_graphs=False,  # tp > 1 runs eagerly: compare like with like
    )


def token_agreement(prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = {}
    for tp in (1, 2):
        with _llm(tp, "float32") as llm:
            outs[tp] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    first_diff = []
    for a, b in zip(outs[1], outs[2], strict=True):
        diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        first_diff.append(diff)
    return {
        "prompts": len(prompts),
        "identical": sum(d is None for d in first_diff),
        "first_divergence": first_diff,
    }


def decode_tpot(prompts: list[list[int]], max_tokens: int, reps: int) -> dict[str, Any]:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llms = {tp: _llm(tp, "bfloat16") for tp in (1, 2)}
    try:
        for llm in llms.values():  # warm-up
            llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        times: dict[int, list[float]] = {1: [], 2: []}
        for r in range(reps):
            for tp in (1, 2) if r % 2 == 0 else (2, 1):
                outs = llms[tp].generate(prompts, params, use_tqdm=False)
                tpots = [
                    (o.metrics.finished_time - o.metrics.first_token_time) / (len(o.token_ids) - 1)
                    for o in outs
                    if o.metrics.finished_time is not None
                    and o.metrics.first_token_time is not None
                    and len(o.token_ids) > 1
                ]
                times[tp].append(statistics.median(tpots) * 1000)
    finally:
        for llm in llms.values():
            llm.close()
    ratios = [b / a for a, b in zip(times[1], times[2], strict=True)]
    return {
        "tpot_ms_tp1": times[1],
        "tpot_ms_tp2": times[2],
        "tp2_over_tp1_median": statistics.median(ratios),
        "ratios": ratios,
    }


def _serve(data: dict[str, Any], prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    import httpx

    from cluster.serve import start_cluster

    data["server"]["port"] = 0
    running = start_cluster(config_from_dict(data))
    try:
        model = httpx.get(running.url + "/v1/models", timeout=60).json()["data"][0]["id"]
        tokens, seconds = [], []
        for p in prompts:
            t0 = time.perf_counter()
            r = httpx.post(
                running.url + "/v1/completions",
                json={
                    "model": model,
                    "prompt": p,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
                timeout=600,
            )
            r.raise_for_status()
            seconds.append(time.perf_counter() - t0)
            tokens.append(r.json()["choices"][0]["token_ids"])
        perf = httpx.get(running.url + "/perf_metrics", timeout=60).json()
    finally:
        running.stop()
    return {"tokens": tokens, "request_seconds": seconds, "perf_metrics": perf}


def cluster_run(prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    big = load_config(CONFIG).model_dump(mode="json")
    run = _serve(big, prompts, max_tokens)
    result["gpu_tp_yaml"] = {
        "tokens_per_request": [len(t) for t in run["tokens"]],
        "request_seconds": run["request_seconds"],
    }
    small = load_config(REPO / "configs" / "gpu_1p1d.yaml").model_dump(mode="json")
    small["prefill"]["tensor_parallel_size"] = 2
    disagg = _serve(small, prompts, max_tokens)
    small["prefill"]["tensor_parallel_size"] = 1
    small["prefill"]["replicas"] = 0
    agg = _serve(small, prompts, max_tokens)
    result["8b_prefill_tp2_decode_tp1_vs_aggregated_tp1"] = {
        "identical": [a == b for a, b in zip(disagg["tokens"], agg["tokens"], strict=True)],
        "first_divergence": [
            next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
            for a, b in zip(disagg["tokens"], agg["tokens"], strict=True)
        ],
    }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="validate the config only (CPU)")
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args()
    report: dict[str, Any] = {"validate": validate()}
    print("config OK:", json.dumps(report["validate"]), flush=True)
    if not args.dry_run:
        import torch

        if torch.cuda.device_count() < 4:
            print(f"needs 4 GPUs, found {torch.cuda.device_count()}")
            return 1
        rng = random.Random(0)
        prompts = [[rng.randrange(1000, 120000) for _ in range(n)] for n in (17, 300, 1000, 64)]
        report["tokens_tp1_vs_tp2"] = token_agreement(prompts, 32)
        print("tokens:", json.dumps(report["tokens_tp1_vs_tp2"]), flush=True)
        batch = [[rng.randrange(1000, 120000) for _ in range(512)] for _ in range(16)]
        report["decode_tpot"] = decode_tpot(batch, 64, args.reps)
        print("tpot:", json.dumps(report["decode_tpot"]), flush=True)
        report["cluster"] = cluster_run(prompts, 16)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
