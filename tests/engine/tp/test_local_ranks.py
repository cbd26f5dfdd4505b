"""Where a tensor-parallel engine's ranks go (engine/tp/local_ranks.py): on CUDA the GPUs from rank
0's own, which a cluster worker's is (the GPU Ray gave it), not GPU 0 of the host."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.engine_config import EngineConfig
from engine.tp.local_ranks import LocalRanks, rank_device


def test_ranks_count_from_rank_0_s_gpu() -> None:
    """A worker on GPU 2 put its rank 0 on GPU 0 (another worker's, or out of memory there)."""
    config = EngineConfig(device="cuda:2", tensor_parallel_size=2)
    assert [rank_device(config, r) for r in range(2)] == ["cuda:2", "cuda:3"]
    cpu = dataclasses.replace(config, device="cpu")
    assert [rank_device(cpu, r) for r in range(2)] == ["cpu", "cpu"]


@pytest.mark.skipif(torch.cuda.device_count() > 8, reason="a host with more than 8 GPUs")
def test_local_ranks_want_the_gpus_from_rank_0_s() -> None:
    config = EngineConfig(device="cuda:7", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"needs GPUs cuda:7 to cuda:8; this host has"):
        LocalRanks(config, 2)
