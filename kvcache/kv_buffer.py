"""The KV storage tensors of the pool groups and the per-layer views attention reads."""

from __future__ import annotations

import torch

from kvcache.spec import PoolGroupSpec


def allocate_buffers(specs: list[PoolGroupSpec], device: torch.device) -> dict[str, torch.Tensor]:
    """One zeroed tensor per group, shaped ``spec.buffer_shape`` (page-major, see kvcache/spec.py).

    Zeroed, not empty: kernels read whole pages and mask by length, and masked garbage that happens to
    be NaN would still poison ``0 * v`` in the weighted sum.
    """
    return {s.name: torch.zeros(s.buffer_shape, dtype=s.dtype, device=device) for s in specs}


def layer_views(
    specs: list[PoolGroupSpec], buffers: dict[str, torch.Tensor]
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Model layer id -> (k_cache, v_cache), each a strided view [num_pages, page_size, Hkv, D]."""
    views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for spec in specs:
        buf = buffers[spec.name]
        for local, layer_id in enumerate(spec.layer_ids):
            if layer_id in views:
                raise ValueError(f"layer {layer_id} appears in more than one pool group")
            # [num_pages, num_layers, 2, page_size, Hkv, D] -> [num_pages, page_size, Hkv, D]
            views[layer_id] = (buf[:, local, 0], buf[:, local, 1])
    return views
