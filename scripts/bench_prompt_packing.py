"""Serialization of one 32k-token request across an actor boundary: packed int32 ids vs a list.

A GenerateRequest crosses two actor boundaries (server -> prefill worker, server -> decode worker),
each a cloudpickle dumps on one side and a loads on the other (what Ray does with a dataclass
argument), and the worker then needs the ids as a list once. This times that hop for the request
as it travels now (ids packed in a PromptTokens, the list built on the worker) next to the same
request with the ids as a plain list, in one run: the variants alternate, in an order that turns
each repetition, and the ratio is taken repetition by repetition (median and quartiles).

    python scripts/bench_prompt_packing.py [--tokens 32768] [--reps 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from ray import cloudpickle

from engine.sampling_params import SamplingParams
from worker_common.messages import GenerateRequest


@dataclass(frozen=True)
class ListRequest:
    """The request as it travelled before: the same fields, the ids as a list."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float


def hop_packed(req: GenerateRequest) -> tuple[int, list[int]]:
    blob = cloudpickle.dumps(req)
    back = cloudpickle.loads(blob)
    return len(blob), back.prompt_token_ids.tolist()


def hop_list(req: ListRequest) -> tuple[int, list[int]]:
    blob = cloudpickle.dumps(req)
    back = cloudpickle.loads(blob)
    return len(blob), back.prompt_token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--vocab", type=int, default=128256, help="ids drawn from [0, vocab)")
    parser.add_argument("--json", help="write the times and ratios here")
    args = parser.parse_args()

    rng = random.Random(0)
    ids = [rng.randrange(args.vocab) for _ in range(args.tokens)]
    sampling = SamplingParams(max_tokens=16)
    packed = GenerateRequest("req-1", ids, sampling, time.time())
    plain = ListRequest("req-1", list(ids), sampling, time.time())
    variants: dict[str, Callable[[], tuple[int, list[int]]]] = {
        "packed": lambda: hop_packed(packed),
        "list": lambda: hop_list(plain),
    }
    sizes = {name: run()[0] for name, run in variants.items()}
    assert hop_packed(packed)[1] == hop_list(plain)[1] == ids
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for rep in range(args.reps):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            start = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - start)
    ratios = sorted(p / q for p, q in zip(times["packed"], times["list"]))
    q1, med, q3 = statistics.quantiles(ratios, n=4)
    print(f"one hop of a {args.tokens}-token request (cloudpickle dumps + loads + the id list):")
    for name in names:
        t = sorted(times[name])
        print(
            f"  {name:6s}  median {statistics.median(t) * 1e3:7.3f} ms   "
            f"p10 {t[len(t) // 10] * 1e3:7.3f} ms   {sizes[name] / 1024:7.1f} KiB pickled"
        )
    print(f"  packed / list, paired per repetition: median {med:.3f} (quartiles {q1:.3f}-{q3:.3f})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "sizes": sizes, "times_s": times, "ratios": ratios}, f)


if __name__ == "__main__":
    main()
