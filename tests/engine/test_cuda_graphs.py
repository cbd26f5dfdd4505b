"""CUDA-graph decode (engine/cuda_graphs.py): the padded sizes, the setting, and on a GPU the tokens
of graph replays against eager steps of the same engine configuration."""

from __future__ import annotations

import pytest
import torch

from engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from engine.engine_config import EngineConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams

TINY = {
    "architecture": "llama",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_layers": 3,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 1024,
}


def test_sizes_cover_every_batch_up_to_the_limit() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    sizes = graph_batch_sizes(37)
    assert sizes[-1] == 37 and all(any(s >= b for s in sizes) for b in range(1, 38))


def test_the_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="yes")  # type: ignore[arg-type]


def test_graphs_refuse_a_cpu_device() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(torch.nn.Linear(1, 1), [], ["full"], 4, 4, torch.device("cpu"))


def test_a_cpu_engine_steps_eagerly() -> None:
    llm = LLM("dummy", load_format="dummy", dummy_config=TINY, num_pages=80, cuda_graphs=True)
    assert llm.engine.runner.graphs is None


def _run(cuda_graphs: bool, dtype: str) -> tuple[list[list[int]], LLM]:
    llm = LLM(
        "dummy",
        load_format="dummy",
        dummy_config=TINY,
        device="cuda",
        dtype=dtype,
        num_pages=256,
        max_num_seqs=12,
        cuda_graphs=cuda_graphs,
        seed=3,
    )
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (int(n),), generator=gen).tolist() for n in range(3, 140, 13)]
    # Different lengths: requests leave the batch at different steps, so B crosses sizes.
    params = [
        SamplingParams(max_tokens=5 + 4 * i, temperature=0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], llm


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replays_give_the_eager_tokens(dtype: str) -> None:
    eager, _ = _run(False, dtype)
    graphed, llm = _run(True, dtype)
    assert llm.engine.runner.graphs is not None
    assert graphed == eager
    llm.engine.kv.check_integrity()
