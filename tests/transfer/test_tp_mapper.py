"""transfer/tp_mapper.py on page tables alone: for prefill tp a and decode tp b in {1, 2, 4}, each
decode rank's segments are the exact head fragments, and applying them to random pools fills its
pages byte for byte with the whole model's KV of its heads (4 KV heads; 2 KV heads where a rank
count above 2 replicates them)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from engine.kv_setup import kv_pool_templates
from engine.model_config import ModelConfig
from kvcache.head_shard import kv_head_shard
from kvcache.spec import MapperKind
from transfer.mapper import MapperError
from transfer.page_table import PageTable
from transfer.pools import page_slice
from transfer.tp_mapper import head_sources, map_tp_pages

MODEL = "tp-model"
PAGES = 12


def model(kv_heads: int) -> ModelConfig:
    return ModelConfig(
        architecture="llama",
        vocab_size=10,
        hidden_size=64,
        num_layers=2,
        num_heads=8,
        num_kv_heads=kv_heads,
        head_dim=8,
        intermediate_size=96,
    )


def rank_specs(kv_heads: int, tp: int) -> list:
    """Each rank's pool group (pages of 4 tokens, float32)."""
    cfg = model(kv_heads)
    return [
        dataclasses.replace(
            kv_pool_templates(cfg, 4, torch.float32, kv_head_shard(kv_heads, tp, r))[0],
            num_pages=PAGES,
        )
        for r in range(tp)
    ]


def rank_rows(whole: torch.Tensor, spec) -> torch.Tensor:  # noqa: ANN001
    """A rank's pool as [pages, page_bytes] uint8 rows: its heads of the whole model's pool
    [pages, heads, layers, 2, page_size, D] (heads outermost: the HND layout)."""
    part = whole[:, spec.head_start : spec.head_start + spec.num_kv_heads].contiguous()
    return part.view(torch.uint8).view(PAGES, spec.page_bytes)


@pytest.mark.parametrize(
    ("a", "b", "kv_heads"),
    [(a, b, 4) for a, b in itertools.product((1, 2, 4), repeat=2)]
    + [(4, 1, 2), (1, 4, 2), (4, 2, 2), (2, 4, 2), (4, 4, 2)],
)
def test_every_decode_rank_gets_its_heads_byte_for_byte(a: int, b: int, kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(a * 10 + b)
    whole = torch.randn((PAGES, kv_heads, 2, 2, 4, 8), generator=gen)
    src_specs, dst_specs = rank_specs(kv_heads, a), rank_specs(kv_heads, b)
    srcs = [PageTable.from_specs(MODEL, [s]) for s in src_specs]
    src_rows = [rank_rows(whole, s) for s in src_specs]
    src_pages = [3, 0, 5, 7]  # page 0: a page the window dropped, moves nothing
    dst_pages = [9, 2, 4, 11]
    for spec in dst_specs:
        dst = PageTable.from_specs(MODEL, [spec])
        plan = map_tp_pages(srcs, dst, {"full": src_pages}, {"full": dst_pages})
        head_bytes = spec.page_bytes // spec.num_kv_heads
        # Each of its heads from exactly one prefill rank: the lowest that holds it.
        heads = [
            h
            for segs in plan.values()
            for s in segs
            for h in range(s.nbytes_per_page // head_bytes)
        ]
        assert len(heads) == spec.num_kv_heads
        for rank, segments in plan.items():
            (seg,) = segments  # one fragment per page per prefill rank
            src = src_specs[rank]
            first = max(src.head_start, spec.head_start)
            assert src.head_start <= first < src.head_start + src.num_kv_heads
            assert seg.src_offset == (first - src.head_start) * head_bytes
            assert seg.dst_offset == (first - spec.head_start) * head_bytes
            assert seg.src_ids.tolist() == [3, 5, 7] and seg.dst_ids.tolist() == [9, 4, 11]
            if src.mapper_kind is MapperKind.REPLICATED:
                assert kv_head_shard(kv_heads, a, rank).primary
        dst_rows = torch.zeros((PAGES, spec.page_bytes), dtype=torch.uint8)
        for rank, segments in plan.items():
            for seg in segments:
                s_ids, d_ids = torch.from_numpy(seg.src_ids), torch.from_numpy(seg.dst_ids)
                src_bytes = page_slice(src_rows[rank], seg.src_offset, seg.nbytes_per_page)
                page_slice(dst_rows, seg.dst_offset, seg.nbytes_per_page)[d_ids] = src_bytes[s_ids]
        expected = rank_rows(whole, spec)
        for s, d in zip(src_pages, dst_pages, strict=True):
            want = expected[s] if s != 0 else torch.zeros_like(expected[s])
            assert torch.equal(dst_rows[d], want), (a, b, spec.head_start, s)


def test_two_prefill_ranks_into_one_decode_rank_are_two_fragments() -> None:
    srcs = [PageTable.from_specs(MODEL, [s]) for s in rank_specs(4, 2)]
    (dst_spec,) = rank_specs(4, 1)
    dst = PageTable.from_specs(MODEL, [dst_spec])
    assert head_sources(srcs, dst, "full") == [(0, 0, 2), (1, 2, 2)]
    plan = map_tp_pages(srcs, dst, {"full": [1]}, {"full": [2]})
    hb = dst_spec.page_bytes // 4
    assert [(r, s.src_offset, s.dst_offset, s.nbytes_per_page) for r, (s,) in plan.items()] == [
        (0, 0, 0, 2 * hb),
        (1, 0, 2 * hb, 2 * hb),
    ]


def test_replicated_heads_are_read_from_their_primary_rank_only() -> None:
    srcs = [PageTable.from_specs(MODEL, [s]) for s in rank_specs(2, 4)]  # heads 0,0,1,1
    assert [t.pools[0].mapper_kind for t in srcs] == ["REPLICATED"] * 4
    (dst_spec,) = rank_specs(2, 1)
    dst = PageTable.from_specs(MODEL, [dst_spec])
    assert head_sources(srcs, dst, "full") == [(0, 0, 1), (2, 1, 1)]


def test_a_head_no_prefill_rank_holds_is_refused() -> None:
    src_specs = rank_specs(4, 2)[:1]  # rank 0 only: heads 0-1
    (dst_spec,) = rank_specs(4, 1)
    with pytest.raises(MapperError, match="no prefill rank holds KV head 2"):
        map_tp_pages(
            [PageTable.from_specs(MODEL, src_specs)],
            PageTable.from_specs(MODEL, [dst_spec]),
            {"full": [1]},
            {"full": [1]},
        )


def test_token_major_pools_are_not_resplit() -> None:
    src_specs = rank_specs(4, 2)
    nhd = [dataclasses.replace(s, mapper_kind=MapperKind.NHD) for s in src_specs]
    (dst_spec,) = rank_specs(4, 1)
    with pytest.raises(MapperError, match="head-major"):
        map_tp_pages(
            [PageTable.from_specs(MODEL, [s]) for s in nhd],
            PageTable.from_specs(MODEL, [dst_spec]),
            {"full": [1]},
            {"full": [1]},
        )
