"""What rank 0 of a tensor-parallel worker sends the other ranks (engine/tp/comm.py broadcasts)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.forward_batch import ForwardBatch


@dataclass(frozen=True)
class TPSetup:
    """Once, after rank 0 sized its KV cache: every rank allocates as many pages per pool group
    (the page ids rank 0's scheduler hands out index every rank's pools)."""

    num_pages: dict[str, int]


@dataclass(frozen=True)
class TPStep:
    """One forward pass: the batch rank 0 built (CPU tensors, no attention plans)."""

    batch: ForwardBatch


def batch_to(batch: ForwardBatch, device: torch.device) -> ForwardBatch:
    """``batch`` with every tensor on ``device`` and no attention plans (each rank plans its own)."""
    return dataclasses.replace(
        batch,
        input_ids=batch.input_ids.to(device),
        positions=batch.positions.to(device),
        slot_mappings={g: t.to(device) for g, t in batch.slot_mappings.items()},
        page_tables={g: t.to(device) for g, t in batch.page_tables.items()},
        seq_lens=batch.seq_lens.to(device),
        cu_seqlens_q=batch.cu_seqlens_q.to(device),
        logits_indices=batch.logits_indices.to(device),
        attention_plans={},
    )
