"""The explicit batch context of one forward pass (no module-level state; STYLE rule 6)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """Tensors describing one step over B sequences and T = sum(query_lens) new tokens.

    Every sequence's new K/V are first written into its pages (``slot_mapping``), then attention reads
    the whole context from the pages: prefix-cached pages, earlier chunks and the new tokens alike.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    slot_mapping: (
        torch.Tensor
    )  # [T] int64, page_id * page_size + offset where each new token's K/V goes
    page_table: torch.Tensor  # [B, max_pages] int32, padded with the null page (0)
    seq_lens: torch.Tensor  # [B] int32, context length after this step (cached + new tokens)
    cu_seqlens_q: torch.Tensor  # [B + 1] int32, prefix sums of the query lengths
    max_query_len: int
    logits_indices: torch.Tensor  # [S] int64, rows of the hidden states whose next token is sampled

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode_only(self) -> bool:
        """True when every sequence brings exactly one new token (the decode kernel applies)."""
        return self.max_query_len == 1
