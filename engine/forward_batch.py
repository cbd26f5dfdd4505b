"""The explicit batch context of one forward pass (no module-level state; STYLE rule 6)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from duet_kernels import AttentionPlan


@dataclass
class ForwardBatch:
    """Tensors describing one step over B sequences and T = sum(query_lens) new tokens.

    Every sequence's new K/V are first written into its pages (``slot_mappings``), then attention
    reads the whole context from the pages: prefix-cached pages, earlier chunks and the new tokens
    alike. Each KV pool group (kvcache/spec.py) has its own pages, so its own slot mapping and page
    table; a layer reads those of its group. A window group's page table shows the null page (0)
    where the pages left the window: columns stay token positions, and the window mask never reads
    them.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    # group -> [T] int64, page_id * page_size + offset where each new token's K/V goes
    slot_mappings: dict[str, torch.Tensor]
    # group -> [B, max_pages] int32, column j = the page of tokens j*page_size.., padded with 0
    page_tables: dict[str, torch.Tensor]
    seq_lens: torch.Tensor  # [B] int32, context length after this step (cached + new tokens)
    cu_seqlens_q: torch.Tensor  # [B + 1] int32, prefix sums of the query lengths
    max_query_len: int
    logits_indices: torch.Tensor  # [S] int64, rows of the hidden states whose next token is sampled
    # (group, sliding window) -> duet_kernels.plan_paged_attention of this step, made by the first layer
    # that reads that group with that window and shared by the others (None: the kernel takes none)
    attention_plans: dict[tuple[str, int | None], AttentionPlan | None] = field(
        default_factory=dict
    )

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode_only(self) -> bool:
        """True when every sequence brings exactly one new token (the decode kernel applies)."""
        return self.max_query_len == 1
