"""Host overhead of one decode iteration: scheduler + KV cache manager + batch preparation.

Everything but the model: ``schedule()`` (page reservation through the real KVCacheManager),
``BatchBuilder.build()`` (the ForwardBatch tensors), the sampling-request list, the prompt rows to
score (none asked here: the cost every step pays) and ``update()``
(progress, page commits for reuse, stop checks). The model's place is taken by a fixed token per
request. Target (shared/ANCHORS.md): <= 1 ms per decode iteration with 256 running requests.

    .venv/bin/python scripts/bench_scheduler.py --num-requests 256 --iterations 300 --rounds 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.batch_builder import BatchBuilder  # noqa: E402
from engine.prompt_logprobs import plan_prompt_logits  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402
from engine.scheduler_config import SchedulerConfig  # noqa: E402
from kvcache.manager import KVCacheManager  # noqa: E402
from kvcache.spec import PoolGroupSpec  # noqa: E402


def build(args: argparse.Namespace) -> tuple[Scheduler, BatchBuilder]:
    rng = random.Random(0)
    max_len = args.max_prompt + args.iterations * args.rounds + 64
    pages_per_req = -(-max_len // args.page_size)
    # A real pool with a tiny page payload: the bookkeeping, not the bytes, is what is measured.
    spec = PoolGroupSpec(
        "full", (0,), args.num_requests * pages_per_req + 1, args.page_size, 1, 8, torch.float32
    )
    kv = KVCacheManager([spec], args.reuse_policy)
    config = SchedulerConfig(
        max_num_seqs=args.num_requests,
        max_num_batched_tokens=16384,
        prefill_chunk_size=2048,
        max_model_len=max_len,
        page_size=args.page_size,
    )
    sched = Scheduler(config, kv)
    params = SamplingParams(
        temperature=0.0, max_tokens=args.iterations * args.rounds + 32, ignore_eos=True
    )
    for i in range(args.num_requests):
        prompt = [
            rng.randrange(1, 50000) for _ in range(rng.randint(args.min_prompt, args.max_prompt))
        ]
        sched.add_request(Request(f"req-{i}", prompt, params))
    return sched, BatchBuilder(args.page_size, config.max_pages_per_seq)


def one_step(sched: Scheduler, builder: BatchBuilder, times: dict[str, list[float]] | None) -> int:
    t0 = time.perf_counter()
    out = sched.schedule()
    t1 = time.perf_counter()
    builder.release(out.released_ids)
    builder.build(out)
    sampling = [r for r, s in zip(out.requests, out.sample, strict=True) if s]
    plan_prompt_logits(out.requests, out.num_new_tokens)  # (what a step scores of prompts)
    t2 = time.perf_counter()
    sched.update(out, [1] * len(sampling))
    t3 = time.perf_counter()
    if times is not None:
        times["schedule"].append(t1 - t0)
        times["build"].append(t2 - t1)
        times["update"].append(t3 - t2)
        times["total"].append(t3 - t0)
    return out.num_decode_tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--iterations", type=int, default=300, help="decode iterations per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-prompt", type=int, default=128)
    parser.add_argument("--max-prompt", type=int, default=1024)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument(
        "--reuse-policy", default="all_reusable", choices=["none", "all_reusable", "per_request"]
    )
    args = parser.parse_args()

    sched, builder = build(args)
    while one_step(sched, builder, None) < args.num_requests:  # prefill everyone
        pass
    for _ in range(20):  # warm-up
        one_step(sched, builder, None)
    print(
        f"decode iteration, {args.num_requests} running requests, page_size {args.page_size}, "
        f"prompts {args.min_prompt}-{args.max_prompt} tokens, reuse {args.reuse_policy}, "
        f"{args.rounds} rounds of {args.iterations} iterations (the machine is shared: best round counts)"
    )
    best = float("inf")
    for rnd in range(args.rounds):
        times: dict[str, list[float]] = {k: [] for k in ("schedule", "build", "update", "total")}
        for _ in range(args.iterations):
            n = one_step(sched, builder, times)
            assert n == args.num_requests, f"expected {args.num_requests} decodes, got {n}"
        parts = []
        for name, values in times.items():
            ms = sorted(v * 1e3 for v in values)
            parts.append(
                f"{name} {statistics.fmean(ms):.3f} (p50 {ms[len(ms) // 2]:.3f}, p99 {ms[int(len(ms) * 0.99)]:.3f})"
            )
        print(f"  round {rnd}: mean ms  " + "  ".join(parts))
        best = min(best, statistics.fmean(times["total"]) * 1e3)
    sched.kv.check_integrity()
    print(
        f"target <= 1 ms per iteration: {'met' if best <= 1.0 else 'NOT met'} (best round mean {best:.3f} ms)"
    )


if __name__ == "__main__":
    main()
