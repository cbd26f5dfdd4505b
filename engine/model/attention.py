"""Paged GQA self-attention: project, (q/k norm), rotary, write K/V into the pages, attend over the pages."""

from __future__ import annotations

import torch
from torch import nn

from duet_kernels import (
    AttentionPlan,
    paged_decode_attention,
    paged_prefill_attention,
    plan_paged_attention,
    rotary,
    store_kv,
)
from engine.forward_batch import ForwardBatch
from engine.model.linear import MergedLinear, RowParallelLinear
from engine.model.norm import RMSNorm
from engine.model_config import ModelConfig
from engine.tp.context import TPContext
from kvcache.spec import FULL_GROUP


class PagedAttention(nn.Module):
    """One layer's attention. The new tokens' K/V go to their slots first, then attention reads the
    whole context (cached prefix, earlier chunks and the new tokens) from the pages.

    Per layer: ``sliding_window`` (None: full attention), ``kv_group`` (the pool group holding this
    layer's pages, whose page table and slot mapping it reads from the batch) and ``softcap`` (of
    the attention scores; None: none).
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype | None = None,
        *,
        sliding_window: int | None = None,
        kv_group: str = FULL_GROUP,
        softcap: float | None = None,
        tp: TPContext | None = None,
    ) -> None:
        super().__init__()
        # With tensor parallelism: this rank's query heads and KV head shard (engine/tp/partition.py).
        self.num_heads = config.num_heads if tp is None else tp.partition.num_heads
        self.num_kv_heads = config.num_kv_heads if tp is None else tp.partition.kv.count
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.sliding_window = sliding_window
        self.kv_group = kv_group
        self.softcap = softcap
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size,
            (q_size, kv_size, kv_size),
            bias=config.attention_bias,
            dtype=dtype,
        )
        self.o_proj = RowParallelLinear(
            q_size, config.hidden_size, bias=config.attention_out_bias, dtype=dtype, tp=tp
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype=dtype)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # each [num_pages, page_size, Hkv, D]
    ) -> torch.Tensor:  # [T, hidden]
        T = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, k, None, cos, sin)  # cos/sin: this step's per-token tables
        k_cache, v_cache = kv_cache
        store_kv(k, v, k_cache, v_cache, batch.slot_mappings[self.kv_group])
        page_table = batch.page_tables[self.kv_group]
        plan = self._plan(batch, page_table, k_cache.shape[1])
        if batch.is_decode_only:
            # One new token per sequence: row b of q belongs to sequence b (T == num_seqs).
            out = paged_decode_attention(
                q,
                k_cache,
                v_cache,
                page_table,
                batch.seq_lens,
                self.scale,
                self.sliding_window,
                self.softcap,
                plan,
            )
        else:
            out = paged_prefill_attention(
                q,
                k_cache,
                v_cache,
                page_table,
                batch.cu_seqlens_q,
                batch.seq_lens,
                self.scale,
                self.sliding_window,
                self.softcap,
                plan,
                max_query_len=batch.max_query_len,
            )
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))

    def _plan(
        self, batch: ForwardBatch, page_table: torch.Tensor, page_size: int
    ) -> AttentionPlan | None:
        """This step's attention plan for the layer's group and window, made once per step."""
        key = (self.kv_group, self.sliding_window)
        if key not in batch.attention_plans:
            cu_seqlens_q = None if batch.is_decode_only else batch.cu_seqlens_q
            batch.attention_plans[key] = plan_paged_attention(
                page_table, batch.seq_lens, cu_seqlens_q, page_size, self.sliding_window
            )
        return batch.attention_plans[key]
