"""GPU check of the whole cluster (run by scripts/gpu_check.sh on a machine with 2 GPUs or more).

Starts configs/gpu_1p1d.yaml (prefill on GPU 0, decode on GPU 1, the decode worker reading the
prefill worker's pages through CUDA IPC: transfer_path "cuda_ipc"), sends greedy
requests as token ids (dummy weights have no tokenizer), then does the same on the aggregated twin
and checks that both give the same tokens; prints the transfer figures from /perf_metrics.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import httpx

from cluster.config import config_from_dict, load_config
from cluster.serve import start_cluster

REPO = Path(__file__).resolve().parents[1]


def run(
    config_name: str, prompts: list[list[int]], max_tokens: int
) -> tuple[list[list[int]], list[dict]]:
    data = load_config(REPO / "configs" / config_name).model_dump(mode="json")
    data["server"]["port"] = 0
    running = start_cluster(config_from_dict(data))
    try:
        model = httpx.get(running.url + "/v1/models", timeout=60).json()["data"][0]["id"]
        outs = []
        for p in prompts:
            r = httpx.post(
                running.url + "/v1/completions",
                json={
                    "model": model,
                    "prompt": p,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
                timeout=300,
            )
            r.raise_for_status()
            outs.append(r.json())
        perf = httpx.get(running.url + "/perf_metrics", timeout=60).json()
        return [o["choices"][0]["token_ids"] for o in outs], perf
    finally:
        running.stop()


def main() -> int:
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 120000) for _ in range(n)] for n in (17, 300, 2000, 4000)]
    disagg, perf = run("gpu_1p1d.yaml", prompts, 16)
    agg, _ = run("gpu_1p1d_aggregated.yaml", prompts, 16)
    same = [len(a) == 16 and a == b for a, b in zip(disagg, agg)]
    transfers = [
        {
            "prompt_tokens": r["prompt_tokens"],
            "transfer_bytes": r["transfer_bytes"],
            "transfer_path": r.get("transfer_path"),
            "transfer_s": r["transfer_time"],
            "gbps": (r["transfer_bytes"] / r["transfer_time"] / 1e9)
            if r.get("transfer_time")
            else None,
            "ttft_s": r["ttft"],
            "tpot_s": r["tpot"],
        }
        for r in perf
    ]
    print(json.dumps({"same_text_as_aggregated": same, "transfers": transfers}, indent=1))
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
