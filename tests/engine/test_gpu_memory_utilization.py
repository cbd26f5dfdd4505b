"""vLLM's ``gpu_memory_utilization`` on a GPU: the engine takes that share of the device's memory in
all (weights, KV, a step's activations), whatever the share."""

from __future__ import annotations

import gc

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
    total = torch.cuda.get_device_properties(0).total_memory
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
    held = torch.cuda.memory_reserved(0)
    kv = llm.engine.kv.stats()
    del llm
    assert held <= utilization * total
    assert held >= (utilization - 0.05) * total, (held, kv)
