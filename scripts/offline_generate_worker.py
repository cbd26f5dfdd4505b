"""One system's offline generation in a process of its own, for scripts/bench_vs_vllm_cpu.py: loads
vLLM's ``LLM``, Duet's ``engine.LLM`` or HF transformers once, then answers requests on stdin.

    python scripts/offline_generate_worker.py --system {vllm,duet,hf} --checkpoint DIR [--threads N]

Protocol (one JSON object a line): after loading, the worker prints ``@@BENCH {"ready": ...}`` on
stdout; each request line ``{"prompts": [[ids]], "max_tokens": N}`` gets ``@@BENCH {"seconds": s,
"cpu_seconds": c, "token_ids": [[ids]]}`` (greedy, exactly N new tokens each: EOS ignored); an
empty line or EOF ends it. Other stdout lines are the libraries' own output. This file imports only
the standard library at the top, so that it also runs in the vLLM venv, which has no Duet packages.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

MARK = "@@BENCH "
Generate = Callable[[list[list[int]], int], list[list[int]]]


def _vllm(args: argparse.Namespace) -> Generate:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(args.checkpoint),
        dtype="float32",
        max_model_len=args.max_model_len,
        seed=0,
        kv_cache_memory_bytes=args.kv_bytes,
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate


def _duet(args: argparse.Namespace) -> Generate:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM("default", max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_bytes)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return [
            list(o.token_ids)
            for o in llm.generate([list(p) for p in prompts], params, use_tqdm=False)
        ]

    return generate


def _hf(args: argparse.Namespace) -> Generate:
    import torch
    from transformers import AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    pad = model.generation_config.eos_token_id
    pad_id = pad[0] if isinstance(pad, list) else pad

    from bench_offline import hf_generate  # this script's folder: the HF run of bench_offline.py

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return hf_generate(model, prompts, max_tokens, pad_id)

    return generate


SYSTEMS: dict[str, Callable[[argparse.Namespace], Generate]] = {
    "vllm": _vllm,
    "duet": _duet,
    "hf": _hf,
}


def _reply(payload: dict) -> None:
    sys.stdout.write(MARK + json.dumps(payload) + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--system", choices=sorted(SYSTEMS), required=True)
    parser.add_argument("--checkpoint", type=Path, required=True, help="the HF checkpoint dir")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-bytes", type=int, default=1 << 30, help="KV cache bytes")
    args = parser.parse_args()
    start = time.perf_counter()
    generate = SYSTEMS[args.system](args)
    import torch  # loaded by every system by now

    _reply(
        {
            "ready": args.system,
            "load_seconds": time.perf_counter() - start,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "pid": os.getpid(),
        }
    )
    for line in sys.stdin:
        if not line.strip():
            break
        request = json.loads(line)
        wall, cpu = time.perf_counter(), time.process_time()
        token_ids = generate(request["prompts"], request["max_tokens"])
        _reply(
            {
                "seconds": time.perf_counter() - wall,
                "cpu_seconds": time.process_time() - cpu,
                "token_ids": token_ids,
            }
        )


if __name__ == "__main__":
    main()
