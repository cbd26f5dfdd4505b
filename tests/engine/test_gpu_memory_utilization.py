"""vLLM's ``gpu_memory_utilization`` on a GPU: the engine takes that share of the device's memory in
all (weights, KV, a step's activations), whatever the share, and refuses a share that other
processes left it less than."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("utilization", [0.3, 0.5])
def test_the_engine_takes_its_share_of_the_gpu(utilization: float) -> None:
    gc.collect()
    torch.cuda.empty_cache()
    free_before, total = torch.cuda.mem_get_info(0)
    reserved_before = torch.cuda.memory_reserved(0)
    # The 8B shape in bf16 (16 GB of weights): 256 requests of 8192 tokens would hold 256 GB of
    # KV, so the share, not the scheduler's limits, sizes the pool.
    llm = LLM(
        "llama-3-8b",
        generation_config="none",
        load_format="dummy",
        dtype="bfloat16",
        device="cuda",
        gpu_memory_utilization=utilization,
        enforce_eager=True,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[1, 2, 3]] * 8, greedy, use_tqdm=False)[0].token_ids) == 4
    held = torch.cuda.memory_reserved(0) - reserved_before
    # All the engine took from the device, its cuBLAS and Triton state outside torch's allocator
    # included (this process's CUDA context was there before).
    footprint = free_before - torch.cuda.mem_get_info(0)[0]
    kv = llm.engine.kv.stats()
    del llm
    assert footprint <= utilization * total + (256 << 20), (footprint, held, kv)
    assert held >= (utilization - 0.05) * total, (held, kv)


def test_a_share_other_processes_took_is_refused() -> None:
    """vLLM's rule: another process holds 60% of the GPU, so a share of 0.5 cannot be had; the
    engine refuses to start rather than take less than it was told."""
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    hog = subprocess.Popen(  # (holds its tensor until its stdin closes)
        [
            sys.executable,
            "-c",
            "import sys, torch; t = torch.empty(int(sys.argv[1]), dtype=torch.uint8, "
            "device='cuda'); print('held', flush=True); sys.stdin.read()",
            str(int(0.6 * total)),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match="were left by other processes"):
            LLM(
                "llama-3-8b",
                generation_config="none",
                load_format="dummy",
                dtype="bfloat16",
                device="cuda",
                gpu_memory_utilization=0.5,
                enforce_eager=True,
            )
    finally:
        assert hog.stdin is not None
        hog.stdin.close()
        hog.wait(timeout=60)


ENGINE_IN_A_PROCESS = """
import sys, torch
from engine.llm import LLM
llm = LLM("llama-3-8b", generation_config="none", load_format="dummy", dtype="bfloat16",
          device="cuda", gpu_memory_utilization=0.4, enforce_eager=True)
print("pages", llm.engine.kv.stats().total, flush=True)
sys.stdin.read()  # (holds the engine until the test is done with both)
"""


def test_two_engines_starting_at_once_on_one_gpu_each_get_their_share() -> None:
    """Two cluster workers with resources.num_gpus 0.5 start side by side on one GPU. Each
    charged itself the other's allocations as they happened (the free pool cannot tell whose)
    and one found no room in its share; they now size in turns (engine/gpu_sizing_lock.py)."""
    gc.collect()
    torch.cuda.empty_cache()
    engines = [
        subprocess.Popen(
            [sys.executable, "-c", ENGINE_IN_A_PROCESS],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        lines = [e.stdout.readline() for e in engines]  # type: ignore[union-attr]
        assert all(line.startswith("pages ") for line in lines), [
            e.stderr.read() if e.poll() is not None else ""
            for e in engines  # type: ignore[union-attr]
        ]
        pages = [int(line.split()[1]) for line in lines]
        assert min(pages) > 0.9 * max(pages), pages  # (the same share each)
    finally:
        for e in engines:
            e.stdin.close()  # type: ignore[union-attr]
            e.wait(60)
