"""A fresh engine's first requests with and without its warm-up (EngineConfig.warm_up), same run.

Each mode runs in a process of its own, started fresh, in turn (cold, warm, cold, warm, ...), with
an empty Triton cache each, as on a machine that never ran Duet: the one-time costs of a first
request show in full. Every process builds an engine, then times four prompts one after another
(distinct first tokens, so no prefix hits), one output token each: the first one's time against
the later ones' is what the warm-up is for, the build time what it costs.

    .venv/bin/python scripts/bench_first_request.py                     # embedded model, CPU
    python scripts/bench_first_request.py --device cuda --model llama-3-8b --load-format dummy \\
        --dtype bfloat16                                                # the 8B shape on a GPU

Writes the runs as JSON (``--out``) and prints the medians and the ratio first / later.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT_LENS = (1000, 1000, 1000, 777)


def one_process(args: argparse.Namespace) -> dict:
    """Build an engine in this process and time its first prompts."""
    sys.path.insert(0, str(ROOT))
    import torch

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    start = time.perf_counter()
    llm = LLM(
        args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        max_model_len=2048,
        max_num_seqs=64,
        warm_up=args.warm_up == 1,
    )
    build_s = time.perf_counter() - start
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for i, n in enumerate(PROMPT_LENS):
        prompt = [(i + 1 + j * 7919) % (vocab - 1) + 1 for j in range(n)]
        sync()
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        sync()
        times.append(time.perf_counter() - start)
    return {"warm_up": args.warm_up == 1, "build_s": build_s, "request_s": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=2, help="cold/warm pairs")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--warm-up", type=int, choices=(0, 1), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warm_up is not None:  # a child: one engine, one JSON line
        print(json.dumps(one_process(args)), flush=True)
        return
    runs = []
    for _ in range(args.rounds):
        for mode in ("0", "1"):
            env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="duet-triton-"))
            child = [sys.executable, __file__, *sys.argv[1:], "--warm-up", mode]
            done = subprocess.run(child, env=env, capture_output=True, text=True, timeout=900)
            lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
            if done.returncode != 0 or not lines:
                sys.exit(f"child (warm_up={mode}) failed:\n{done.stderr[-3000:]}")
            runs.append(json.loads(lines[-1]))
            print(lines[-1], flush=True)
    summary = {}
    for warm in (False, True):
        mine = [r for r in runs if r["warm_up"] is warm]
        first = statistics.median(r["request_s"][0] for r in mine)
        later = statistics.median(t for r in mine for t in r["request_s"][1:])
        build = statistics.median(r["build_s"] for r in mine)
        summary["warm" if warm else "cold"] = {
            "build_s": build,
            "first_s": first,
            "later_s": later,
            "first_over_later": first / later,
        }
        name = "warm-up  " if warm else "no warm-up"
        print(
            f"{name}: build {build:.2f} s, first request {first * 1e3:.1f} ms, later "
            f"{later * 1e3:.1f} ms (first / later {first / later:.2f})"
        )
    if args.out is not None:
        settings = {k: v for k, v in vars(args).items() if k not in ("out", "warm_up")}
        record = {"settings": settings, "runs": runs, "summary": summary}
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
