"""What the engine's decoder models share: building without the random init, loading HF-named
weights (the checkpoint's q/k/v and gate/up projections stacked into one matmul each), and the
float32 logits of the sampled rows."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Self

import torch
from torch import nn

from duet_kernels import linear
from engine.model.linear import Linear, MergedLinear, PackedWeight
from engine.model_config import ModelConfig
from engine.tp.context import TPContext
from engine.tp.shard_weights import hf_shard

# HF projection name -> (merged module, shard index); the checkpoint keeps them apart, we stack them.
_STACKED: dict[str, tuple[str, int]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_STACKED_NAME = re.compile(
    r"^(model\.layers\.\d+)\.(self_attn\.[qkv]_proj|mlp\.(?:gate|up)_proj)\.(weight|bias)$"
)


class PagedCausalLMBase(nn.Module):
    """A decoder over the paged KV cache: subclasses build ``model`` (with ``embed_tokens``) and
    ``lm_head`` (None with tied embeddings) and define ``forward(batch, kv_caches)``.

    Parameter names follow HF checkpoints except for the stacked ``qkv_proj`` and ``gate_up_proj``;
    ``load_weights`` takes HF names.
    """

    config: ModelConfig
    model: nn.Module
    lm_head: Linear | None
    tp: TPContext | None

    def __init__(self) -> None:
        super().__init__()
        # The tied embedding in duet_kernels.linear's layout (remade when the weight is written).
        self.tied_lm_head = PackedWeight()

    @classmethod
    def build(
        cls,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TPContext | None = None,
    ) -> Self:
        """An instance with uninitialised parameters on ``device`` (skips the random init that a
        checkpoint overwrites anyway); fill it with ``load_weights`` or engine/loaders/dummy.py.
        With ``tp``: the rank's shard of every split layer (engine/tp/shard_weights.py)."""
        with torch.device("meta"):
            model = cls(config, dtype=dtype, tp=tp)  # type: ignore[call-arg]
        model.to_empty(device=device)
        for module in model.modules():
            reset = getattr(module, "reset_buffers", None)
            if reset is not None:  # buffers derived from the config (rotary frequencies)
                reset()
        return model.eval()

    def compute_logits(
        self, hidden: torch.Tensor, logits_indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden [T, hidden] -> float32 logits [S, vocab] of the rows ``logits_indices`` (all rows
        if None), soft-capped when the config says so."""
        if logits_indices is not None:
            hidden = hidden[logits_indices]
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        else:
            weight = self.model.embed_tokens.weight
            logits = linear(hidden, weight, packed=self.tied_lm_head.get(weight))
        cap = self.config.final_logit_softcapping
        if cap is not None:  # in the model's dtype, as transformers does, then float32
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> None:
        """Copy HF-named tensors into the parameters (converting dtype and device).

        Unknown names raise ValueError; with ``strict`` so does any parameter left unloaded. With
        tensor parallelism a tensor may be the whole checkpoint tensor (cut here to the rank's
        part) or already that part (a loader that read only it).
        """
        params = dict(self.named_parameters())
        loaded: set[tuple[str, int]] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # derived from the config, stored by some old checkpoints
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the output projection
            tensor = self._rank_part(name, tensor)
            match = _STACKED_NAME.match(name)
            if match:
                prefix, proj, kind = match.groups()
                module_name, shard = _STACKED[proj]
                module = self.get_submodule(f"{prefix}.{module_name}")
                assert isinstance(module, MergedLinear)
                module.load_shard(shard, kind, tensor)
                loaded.add((f"{prefix}.{module_name}.{kind}", shard))
                continue
            if name not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no parameter in {type(self).__name__} ({self.config.architecture})"
                )
            param = params[name]
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                )
            param.data.copy_(tensor)
            loaded.add((name, 0))
        if strict:
            missing = [
                name for name, shard in self._expected_shards() if (name, shard) not in loaded
            ]
            if missing:
                raise ValueError(
                    f"{len(missing)} parameters missing from the checkpoint, e.g. {sorted(set(missing))[:5]}"
                )

    def checkpoint_tensors(self) -> Iterator[tuple[str, tuple[int, ...], float | None]]:
        """(HF name, whole shape, identity value or None) of every tensor a checkpoint of this
        model holds, tensor parallelism undone: what a dummy loader must make."""
        dtype = next(self.parameters()).dtype
        with torch.device("meta"):
            whole = type(self)(self.config, dtype=dtype)  # type: ignore[call-arg]
        unstack = {merged: [] for merged, _ in _STACKED.values()}
        for proj, (merged, _) in _STACKED.items():
            unstack[merged].append(proj)
        for module_name, module in whole.named_modules():
            identity = getattr(module, "identity_weight", None)
            for param_name, param in module.named_parameters(recurse=False):
                full = f"{module_name}.{param_name}"
                prefix, _, leaf = module_name.rpartition(".")
                prefix, _, parent = prefix.rpartition(".")
                merged = f"{parent}.{leaf}"
                if isinstance(module, MergedLinear) and merged in unstack:
                    for proj, rows in zip(unstack[merged], module.shard_sizes, strict=True):
                        shape = (rows, *param.shape[1:])
                        yield f"{prefix}.{proj}.{param_name}", shape, None
                    continue
                ident = identity if identity is not None and param_name == "weight" else None
                yield full, tuple(param.shape), ident

    def _rank_part(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The rank's part of ``tensor``: cut from the whole one, or as given when a loader read
        only that part (a split dimension already of the part's length)."""
        if self.tp is None or self.tp.size == 1:
            return tensor
        cut = hf_shard(name, tuple(tensor.shape), self.tp.partition)
        if cut is None:
            return tensor
        dim, start, stop = cut
        if tensor.shape[dim] == stop - start:
            return tensor
        return tensor.narrow(dim, start, stop - start)

    def _expected_shards(self) -> list[tuple[str, int]]:
        expected: list[tuple[str, int]] = []
        for module_name, module in self.named_modules():
            for param_name, _ in module.named_parameters(recurse=False):
                full = f"{module_name}.{param_name}" if module_name else param_name
                shards = len(module.shard_sizes) if isinstance(module, MergedLinear) else 1
                expected.extend((full, shard) for shard in range(shards))
        return expected
