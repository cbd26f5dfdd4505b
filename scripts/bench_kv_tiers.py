"""KV host tier and KV-aware routing on the local CPU cluster: `duet bench` on a multi-turn workload
whose reuse exceeds the device pools, for five cluster variants in one run.

Variants (2 prefill + 1 decode workers of SmolLM2-135M, float32, each with a small device pool):
the host tier off / on x router.policy load_balance / kv_aware, and kv_aware with the tier and
conditional disaggregation (router.local_prefill_max_tokens). Each repetition runs every variant
once, the order turned by one each repetition; every run is a fresh cluster (`duet bench CONFIG`
starts and stops it) and the same requests. Reported per variant: TTFT median and p99 (and the
median's ratio to the baseline's of the same repetition), prefix hit rate by medium (device, host;
from /perf_metrics), requests prefilled on the decode worker, the host tiers' counters (offloaded,
loaded back, drops, skipped stores; from /metrics) and goodput (requests/s meeting the TTFT SLO),
median over repetitions with each repetition's figure and the load average kept in the JSON.

    PYTHONPATH=. .venv/bin/python scripts/bench_kv_tiers.py --repetitions 3 --conversations 8 \
        --out docs/benchmarks/kv_tiers.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
PAGE_BYTES = 30 * 2 * 16 * 3 * 64 * 4  # SmolLM2-135M float32: one page of 16 tokens, all layers

VARIANTS: dict[str, dict[str, Any]] = {
    "off / load_balance": {"host_pages": 0, "policy": "load_balance", "threshold": 0},
    "on / load_balance": {"host_pages": None, "policy": "load_balance", "threshold": 0},
    "off / kv_aware": {"host_pages": 0, "policy": "kv_aware", "threshold": 0},
    "on / kv_aware": {"host_pages": None, "policy": "kv_aware", "threshold": 0},
    "on / kv_aware + local prefill": {"host_pages": None, "policy": "kv_aware", "threshold": None},
}


def variant_config(args: argparse.Namespace, variant: dict[str, Any]) -> dict[str, Any]:
    base = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    half = {"num_cpus": 0.5, "num_gpus": 0}
    base["model"]["max_model_len"] = args.max_model_len
    base["prefill"].update(replicas=2, resources=half)
    base["decode"]["resources"] = half
    host = args.host_pages if variant["host_pages"] is None else variant["host_pages"]
    base["kvcache"].update(
        cpu_bytes=(args.device_pages + 1) * PAGE_BYTES, host_tier_bytes=host * PAGE_BYTES
    )
    threshold = args.threshold if variant["threshold"] is None else variant["threshold"]
    base["router"].update(policy=variant["policy"], local_prefill_max_tokens=threshold)
    base["server"]["port"] = 0
    base["stats"]["interval_s"] = 1.0
    return base


def run_variant(args: argparse.Namespace, name: str, rep: int, workdir: Path) -> dict[str, Any]:
    slug = name.replace(" / ", "_").replace(" + ", "_").replace(" ", "_")
    config = workdir / f"{slug}.yaml"
    config.write_text(yaml.safe_dump(variant_config(args, VARIANTS[name])))
    result = workdir / f"{slug}-{rep}.json"
    cmd = [
        sys.executable,
        "-m",
        "cluster.bench",
        str(config),
        "--workload",
        "multi-turn",
        "--num-prompts",
        str(args.conversations * args.turns),
        "--num-turns",
        str(args.turns),
        "--input-len",
        str(args.input_len),
        "--turn-len",
        str(args.turn_len),
        "--output-len",
        str(args.output_len),
        "--request-rate",
        str(args.rate),
        "--goodput",
        f"ttft:{args.ttft_slo_ms}",
        "--seed",
        str(args.seed),
        "--result-file",
        str(result),
        "--no-plots",
        "--disable-tqdm",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(
            f"{name}: duet bench failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        )
    run = json.loads(result.read_text())["targets"][0]["runs"][0]
    keep = (
        "completed", "failed", "duration", "median_ttft_ms", "p99_ttft_ms", "mean_ttft_ms",
        "request_throughput", "request_goodput", "slo_attainment", "prefix_hit_rate_device",
        "prefix_hit_rate_host", "num_prefilled_on_decode", "mean_transfer_bytes",
        "num_server_metrics", "kv_host_offloaded_pages", "kv_host_loaded_back_pages",
        "kv_host_host_hit_tokens", "kv_host_host_drops", "kv_host_skipped_stores",
    )  # fmt: skip
    return {k: run.get(k) for k in keep}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--input-len", type=int, default=160)
    p.add_argument("--turn-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--rate", type=float, default=1.0, help="requests/s (Poisson)")
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    p.add_argument("--device-pages", type=int, default=32, help="usable pages per worker")
    p.add_argument("--host-pages", type=int, default=256, help="host-tier pages per worker")
    p.add_argument("--threshold", type=int, default=64, help="local_prefill_max_tokens")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    names = list(VARIANTS)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    load = {"start": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="kv_tiers_") as tmp:
        for rep in range(args.repetitions):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                runs[name].append(run_variant(args, name, rep, Path(tmp)))
                print(f"rep {rep} {name}: {runs[name][-1]}", flush=True)
    load["end"] = os.getloadavg()

    # TTFT over the same repetition's baseline (the first variant): paired, so that the load
    # of the shared machine during that repetition cancels out as far as it can.
    ratios = {
        name: [
            r["median_ttft_ms"] / b["median_ttft_ms"]
            for r, b in zip(runs[name], runs[names[0]], strict=True)
            if r.get("median_ttft_ms") and b.get("median_ttft_ms")
        ]
        for name in names
    }

    def med(name: str, key: str) -> float | None:
        values = [r[key] for r in runs[name] if r.get(key) is not None]
        return statistics.median(values) if values else None

    summary = {
        name: {
            key: med(name, key)
            for key in (
                "median_ttft_ms",
                "p99_ttft_ms",
                "prefix_hit_rate_device",
                "prefix_hit_rate_host",
                "num_prefilled_on_decode",
                "request_goodput",
                "slo_attainment",
                "kv_host_offloaded_pages",
                "kv_host_loaded_back_pages",
                "kv_host_host_drops",
                "kv_host_skipped_stores",
            )  # fmt: skip
        }
        | {"median_ttft_paired_ratio": statistics.median(ratios[name]) if ratios[name] else None}
        for name in names
    }
    header = (
        f"{'variant':32} {'TTFT p50 ms':>11} {'x base':>7} {'TTFT p99 ms':>11} {'hit dev':>8} "
        f"{'hit host':>8} {'on D':>5} {'goodput':>8}"
    )
    print(header)
    for name in names:
        s = summary[name]
        ratio = s["median_ttft_paired_ratio"] or float("nan")
        print(
            f"{name:32} {s['median_ttft_ms'] or float('nan'):11.0f} {ratio:7.2f} "
            f"{s['p99_ttft_ms'] or float('nan'):11.0f} {100 * (s['prefix_hit_rate_device'] or 0):7.1f}% "
            f"{100 * (s['prefix_hit_rate_host'] or 0):7.1f}% {s['num_prefilled_on_decode'] or 0:5.0f} "
            f"{s['request_goodput'] or 0:8.3f}"
        )
    if args.out is not None:
        doc = {
            "settings": vars(args) | {"out": str(args.out)},
            "load_average_1_5_15": load,
            "summary": summary,
            "ttft_paired_ratios": ratios,
            "runs": runs,
        }
        args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
