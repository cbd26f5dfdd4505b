"""Dense layers (``x @ weight.T + bias``) on CPU through oneDNN; ``torch.nn.functional.linear`` is
the reference twin.

In float32 on x86, ``F.linear`` runs MKL's sgemm, which on this project's CPU hosts (AMD EPYC) takes
about twice the time of oneDNN's matmul on the same core: 80-95 against 150-210 GFLOP/s on one core
for the SmolLM2 shapes, at 32 to 2048 rows (.bench probes, 2026-12). oneDNN's linear is reachable from
eager torch as ``torch.ops.mkldnn._linear_pointwise``, the op that torch.compile's CPU fusions emit
(vLLM's CPU build also runs its linear layers on oneDNN). Its results differ from sgemm's by float32
rounding only (a different summation order).

A weight packed once into oneDNN's blocked layout (``pack_weight``, an opaque mkldnn tensor) saves
the per-call reorder: 20-30% at 32 rows, up to 2.5x at a few rows (one core), with results equal to
the unpacked call from 2 rows up. The packed copy doubles the weight's memory.
"""

from __future__ import annotations

import torch


def onednn_available() -> bool:
    """Whether this torch build has oneDNN (x86 and aarch64 CPU builds do)."""
    return torch.backends.mkldnn.is_available()


# The row count oneDNN tunes a packed layout for; any row count runs on it (decode batches are small).
PACK_ROWS = 32


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out_features, in_features] float32 in oneDNN's layout for linear_cpu."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def linear_cpu(
    x: torch.Tensor,  # [..., in_features], float32, on the CPU
    weight: torch.Tensor,  # [out_features, in_features], dense or from pack_weight
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [..., out_features]
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
