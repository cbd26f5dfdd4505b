"""TPFollower: rank r > 0 of a tensor-parallel worker. It holds its shard of the weights and its
head shard of every KV page, and runs the forward pass of each step rank 0 broadcasts (rank 0
owns the scheduler, the page accounting and the sampling; this rank only computes its part and
joins the all-reduces). ``None`` from rank 0 ends the loop."""

from __future__ import annotations

import dataclasses
import logging

import torch

from engine.engine_config import EngineConfig
from engine.host_malloc import keep_freed_memory
from engine.kv_setup import kv_pool_templates
from engine.tp.comm import TPGroup
from engine.tp.context import TPContext
from engine.tp.messages import TPSetup, TPStep, batch_to
from engine.tp.partition import TPPartition
from kvcache.kv_buffer import allocate_buffers, layer_views

logger = logging.getLogger(__name__)


class RankZeroGone(Exception):
    """Rank 0's connection closed between steps: its process ended (a script that exits without
    ``LLM.close()`` ends its ranks at exit too: engine/engine_build.py)."""


class TPFollower:
    def __init__(
        self,
        config: EngineConfig,
        rank: int,
        size: int,
        port: int,
        device: str,
        host: str = "127.0.0.1",
    ) -> None:
        from engine.loaders import load_model
        from engine.loaders.load import read_model_config

        self.device = torch.device(device)
        if self.device.type == "cuda":  # NCCL and the kernels launch on the current device
            torch.cuda.set_device(self.device)
        else:
            keep_freed_memory()  # as rank 0's runner does (engine/host_malloc.py)
        model_config = read_model_config(config.model, config.load_format, config.dummy_config)
        partition = TPPartition(model_config, rank, size)
        self.group = TPGroup.connect(rank, size, port, self.device, host)
        self.tp = TPContext(partition, self.group)
        loaded = load_model(
            config.model,
            config.load_format,
            config.torch_dtype,
            self.device,
            config.dummy_config,
            config.seed,
            tp=self.tp,
        )
        self.model = loaded.model
        setup = self.group.broadcast_object()
        if not isinstance(setup, TPSetup):
            raise RuntimeError(f"rank {rank}: expected the KV set-up from rank 0, got {setup!r}")
        templates = kv_pool_templates(
            model_config, config.page_size, config.torch_dtype, partition.kv
        )
        self.specs = [dataclasses.replace(t, num_pages=setup.num_pages[t.name]) for t in templates]
        self.buffers = allocate_buffers(self.specs, self.device)
        views = layer_views(self.specs, self.buffers)
        self.kv_caches = [views[layer] for layer in range(model_config.num_layers)]

    def step(self) -> bool:
        """Run the next step rank 0 sends; False when rank 0 said stop. RankZeroGone when its
        connection closed while this rank waited for the next step (rank 0's process ended)."""
        try:
            message = self.group.broadcast_object()
        except Exception as e:
            raise RankZeroGone(f"rank 0 went away while rank {self.group.rank} waited: {e}") from e
        if message is None:
            return False
        if not isinstance(message, TPStep):
            raise RuntimeError(f"rank {self.group.rank}: unexpected message {message!r}")
        with torch.inference_mode():
            self.model.forward(batch_to(message.batch, self.device), self.kv_caches)
        return True

    def run(self) -> None:
        while self.step():
            pass
