"""Which part of a checkpoint tensor (HF names) a tensor-parallel rank holds.

Column-parallel (output rows split): q_proj (the rank's query heads), k_proj and v_proj (its KV
head shard, one head when replicated), gate_proj and up_proj (its slice of the MLP width).
Row-parallel (input columns split): o_proj and down_proj weights; their bias (if any) is added
once after the all-reduce, so it stays whole. Everything else (embeddings, norms, the LM head) is
replicated. Loaders use ``hf_shard`` to read only the rank's part (safetensors slices) or to cut a
tensor they had to decode whole (GGUF, dummy).
"""

from __future__ import annotations

import torch

from engine.tp.partition import TPPartition


def hf_shard(name: str, shape: tuple[int, ...], part: TPPartition) -> tuple[int, int, int] | None:
    """``(dim, start, stop)``: the rank's part of checkpoint tensor ``name`` of ``shape``, or
    None when the rank holds it whole."""
    if part.size == 1:
        return None
    pieces = name.split(".")
    if len(pieces) < 2:
        return None
    proj, kind = pieces[-2], pieces[-1]
    cfg = part.config
    d = cfg.head_dim
    if proj == "q_proj":
        return 0, part.q_start * d, (part.q_start + part.num_heads) * d
    if proj in ("k_proj", "v_proj"):
        kv = part.kv
        return 0, kv.start * d, kv.stop * d
    if proj in ("gate_proj", "up_proj"):
        width = part.intermediate_size
        return 0, part.rank * width, (part.rank + 1) * width
    if kind != "weight" or len(shape) != 2:
        return None
    if proj == "o_proj":
        return 1, part.q_start * d, (part.q_start + part.num_heads) * d
    if proj == "down_proj":
        width = part.intermediate_size
        return 1, part.rank * width, (part.rank + 1) * width
    return None


def shard_tensor(name: str, tensor: torch.Tensor, part: TPPartition) -> torch.Tensor:
    """The rank's part of a whole checkpoint tensor (a view)."""
    cut = hf_shard(name, tuple(tensor.shape), part)
    if cut is None:
        return tensor
    dim, start, stop = cut
    return tensor.narrow(dim, start, stop - start)
