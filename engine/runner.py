"""The model side of a step: forward over the paged KV cache, logits of the sampled rows, sampling."""

from __future__ import annotations

from typing import Protocol

import torch

from engine.cuda_graphs import DecodeGraphs
from engine.forward_batch import ForwardBatch
from engine.host_malloc import keep_freed_memory
from engine.model.linear import Linear
from engine.prompt_logprobs import PromptLogitsRows
from engine.request import Request
from engine.sampler import Sampler
from engine.tp.comm import TPGroup
from engine.tp.local_ranks import TPRanksLost
from engine.tp.messages import TPStep, batch_to
from kvcache.manager import KVCacheManager


class PagedCausalLM(Protocol):
    """What the runner needs from a model (engine.model.LlamaForCausalLM, Gemma3ForCausalLM)."""

    def forward(
        self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Write the new tokens' K/V into the pages; return hidden states [T, hidden]."""
        ...

    def compute_logits(
        self, hidden: torch.Tensor, logits_indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Float32 logits [S, vocab] of the rows ``logits_indices``."""
        ...


class ModelRunner:
    """Holds the model, the per-layer cache views and the sampler of one engine."""

    def __init__(
        self,
        model: PagedCausalLM,
        kv: KVCacheManager,
        num_layers: int,
        sampler: Sampler,
        tp_group: TPGroup | None = None,
        prompt_slice_rows: int = 1,
    ) -> None:
        self.model = model
        self.prompt_slice_rows = prompt_slice_rows  # (engine/prompt_logprobs.slice_rows)
        # Rank 0 of a tensor-parallel worker: every forward pass starts by sending the batch to
        # the other ranks (engine/tp/follower.py), which join its all-reduces.
        self.tp_group = tp_group
        # Why a tensor-parallel step failed on its way ("" while none has): the other ranks were
        # left inside its collectives, where no later step can meet them.
        self.tp_failure = ""
        self.kv_groups = list(kv.specs)
        self.kv_caches = [kv.layer_cache(layer) for layer in range(num_layers)]
        self.sampler = sampler
        self.graphs: DecodeGraphs | None = None
        if self.kv_caches and self.kv_caches[0][0].device.type == "cpu":
            keep_freed_memory()  # a CPU forward pass reallocates tens of MB per layer
        # Pack the linear weights into duet_kernels.linear's layout now (oneDNN's on CPU), not in the
        # first request's forward pass: about 0.4 s of the embedded model's first-request latency.
        for module in model.modules():
            if isinstance(module, Linear):
                module.packed_weight.get(module.weight)

    def capture_cuda_graphs(self, max_num_seqs: int, max_pages_per_seq: int) -> None:
        """From now on, decode steps of up to ``max_num_seqs`` rows replay CUDA graphs."""
        device = self.kv_caches[0][0].device
        graphs = DecodeGraphs(
            self.model, self.kv_caches, self.kv_groups, max_num_seqs, max_pages_per_seq, device
        )
        graphs.capture()
        self.graphs = graphs

    def compute_logits(
        self, batch: ForwardBatch, prompt_rows: PromptLogitsRows | None = None
    ) -> torch.Tensor:
        """Forward ``batch`` (filling the KV pages) and return the logits [S, vocab] of its sampled
        rows; ``prompt_rows``' requests get their prompt tokens' logprobs on the way."""
        with torch.inference_mode():
            if self.graphs is not None and prompt_rows is None:
                logits = self.graphs.run(batch)
                if logits is not None:
                    return logits
            if self.tp_group is None:
                return self._forward(batch, prompt_rows)
            if self.tp_failure:
                raise TPRanksLost(
                    f"this engine's tensor-parallel ranks stopped after a failed step "
                    f"({self.tp_failure}); make a new one"
                )
            try:
                self.tp_group.broadcast_object(TPStep(batch_to(batch, torch.device("cpu"))))
                return self._forward(batch, prompt_rows)
            except BaseException as e:  # (a KeyboardInterrupt too: the ranks are left mid-step)
                self.tp_failure = f"{type(e).__name__}: {e}"
                raise

    def _forward(self, batch: ForwardBatch, prompt_rows: PromptLogitsRows | None) -> torch.Tensor:
        hidden = self.model.forward(batch, self.kv_caches)
        if prompt_rows is not None:
            prompt_rows.fill(
                lambda rows: self.model.compute_logits(hidden, rows.to(hidden.device)),
                self.prompt_slice_rows,
            )
        return self.model.compute_logits(hidden, batch.logits_indices)

    def execute(
        self,
        batch: ForwardBatch,
        sampling_requests: list[Request],
        prompt_rows: PromptLogitsRows | None = None,
    ) -> list[int]:
        """One step: the next token of each of ``sampling_requests`` (one per ``logits_indices``
        row); ``prompt_rows`` (engine/prompt_logprobs.py) score prompt tokens as well."""
        if batch.logits_indices.shape[0] != len(sampling_requests):
            raise ValueError(
                f"batch samples {batch.logits_indices.shape[0]} rows but {len(sampling_requests)} requests were given"
            )
        logits = self.compute_logits(batch, prompt_rows)
        if not sampling_requests:
            return []
        with torch.inference_mode():
            return self.sampler.sample(logits, sampling_requests)
