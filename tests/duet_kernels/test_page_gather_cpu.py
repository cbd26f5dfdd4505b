"""duet_kernels/page_gather_cpu.py: the per-head run gather of the head-outermost pool, its workspace
kept across layers and its fallback for other cache layouts, through the CPU decode attention
against its reference twin."""

from __future__ import annotations

import pytest
import torch

from duet_kernels import page_gather_cpu
from duet_kernels.attention_cpu import paged_decode_attention_cpu, plan_decode
from duet_kernels.attention_ref import paged_decode_attention_ref
from kvcache.kv_buffer import layer_view
from tests.duet_kernels.paged_inputs import make_paged_kv


def test_other_cache_layouts_gather_whole_pages_with_the_same_result() -> None:
    """A page-major cache (each page's slots, then heads) has no per-head runs: the gather takes
    whole pages, and gives what the head-outermost pool gives."""
    gen = torch.Generator().manual_seed(21)
    kv = make_paged_kv([37, 5, 64, 16], 16, 2, 32, torch.float32, gen)
    q = torch.randn((4, 4, 32), generator=gen)
    page_major = kv.k_cache.contiguous(), kv.v_cache.contiguous()
    assert page_gather_cpu.head_runs(page_major[0]) is None
    assert page_gather_cpu.head_runs(kv.k_cache) is not None
    out = paged_decode_attention_cpu(q, *page_major, kv.page_table, kv.seq_lens, 0.2)
    same = paged_decode_attention_cpu(q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, 0.2)
    assert torch.equal(out, same)


def test_gathers_reuse_one_workspace_across_layers_and_fall_back_above_its_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gen = torch.Generator().manual_seed(22)
    kv = make_paged_kv([37, 5, 64, 16], 16, 2, 32, torch.float32, gen, num_layers=3)
    q = torch.randn((4, 4, 32), generator=gen)
    plan = plan_decode(kv.page_table, kv.seq_lens, 16)
    outs, storages = [], []
    for layer in range(3):
        k_cache, v_cache = layer_view(kv.buffer, layer)
        outs.append(
            paged_decode_attention_cpu(
                q, k_cache, v_cache, kv.page_table, kv.seq_lens, 0.2, plan=plan
            )
        )
        # (the values are not gathered: weighted_pages_sum reads them in place)
        storages.append(page_gather_cpu.WORKSPACE.buffers[0].data_ptr())
        expected = paged_decode_attention_ref(q, k_cache, v_cache, kv.page_table, kv.seq_lens, 0.2)
        assert float((outs[-1] - expected).abs().max()) <= 1e-5
    assert storages[0] == storages[1] == storages[2]  # no fresh tensor per layer
    monkeypatch.setattr(page_gather_cpu, "WORKSPACE_MAX_BYTES", 64)
    k_cache, v_cache = layer_view(kv.buffer, 2)
    capped = paged_decode_attention_cpu(
        q, k_cache, v_cache, kv.page_table, kv.seq_lens, 0.2, plan=plan
    )
    assert torch.equal(capped, outs[2])


def test_a_new_page_list_gets_its_own_run_ids() -> None:
    """Run ids are kept for the page list of the last gather (every layer of a step reads the
    same pages); another list, even of the same size, gathers its own pages."""
    gen = torch.Generator().manual_seed(23)
    kv = make_paged_kv([40, 40, 17, 33], 16, 2, 32, torch.float32, gen)
    q = torch.randn((2, 4, 32), generator=gen)
    k_cache, v_cache = layer_view(kv.buffer, 1)
    for rows in ([0, 1], [2, 3], [1, 0]):
        table, lens = kv.page_table[rows], kv.seq_lens[rows]
        out = paged_decode_attention_cpu(q, k_cache, v_cache, table, lens, 0.2)
        expected = paged_decode_attention_ref(q, k_cache, v_cache, table, lens, 0.2)
        assert float((out - expected).abs().max()) <= 1e-5


def test_layers_alternating_window_and_full_attention_build_each_index_list_once() -> None:
    """Window and full-attention layers alternate (two page lists a step): each layer gets its own
    list's result, and each list's ids are built once, not once a layer."""
    gen = torch.Generator().manual_seed(25)
    kv = make_paged_kv([70, 40, 17, 53], 16, 2, 32, torch.float32, gen)
    k_cache, v_cache = layer_view(kv.buffer, 1)
    q = torch.randn((4, 4, 32), generator=gen)
    plans = {w: plan_decode(kv.page_table, kv.seq_lens, 16, w) for w in (20, None)}
    assert plans[20].page_ids.numel() < plans[None].page_ids.numel()
    first: dict[int | None, tuple[int, int]] = {}
    for window in (20, None) * 3:
        out = paged_decode_attention_cpu(
            q, k_cache, v_cache, kv.page_table, kv.seq_lens, 0.2, window, plan=plans[window]
        )
        expected = paged_decode_attention_ref(
            q, k_cache, v_cache, kv.page_table, kv.seq_lens, 0.2, window
        )
        assert float((out - expected).abs().max()) <= 1e-5
        held = {
            kind: next(e[2] for e in entries if e[0] is plans[window].page_ids)
            for kind, entries in page_gather_cpu.WORKSPACE.recent.items()
        }
        ids = (id(held["runs"][0]), id(held["bags"][0]))
        assert first.setdefault(window, ids) == ids


@pytest.mark.parametrize("layout", ["head_outermost", "page_major", "bfloat16"])
def test_weighted_pages_sum_is_the_probabilities_times_the_gathered_values(
    layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Probabilities times values read where the pages lie (embedding_bag over the pool's slot
    rows, no gathered copy) in float32 pools of either layout; the gather, in the weights' dtype,
    and a product for other dtypes."""
    gen = torch.Generator().manual_seed(24)
    kv = make_paged_kv([37, 5, 64, 16], 16, 2, 32, torch.float32, gen)
    _, v_cache = layer_view(kv.buffer, 1)
    if layout == "page_major":
        v_cache = v_cache.contiguous()
    elif layout == "bfloat16":
        v_cache = v_cache.to(torch.bfloat16)
    plan = plan_decode(kv.page_table, kv.seq_lens, 16)
    rows, n = 4, plan.page_ids.numel() // 4
    weights = torch.rand((rows, 2, 3, n * 16), generator=gen)
    gathered = page_gather_cpu.gather_pages(v_cache, plan.page_ids, rows, 1).float()
    expected = torch.matmul(weights, gathered)
    gathers = []
    gather = page_gather_cpu.gather_pages
    monkeypatch.setattr(page_gather_cpu, "gather_pages", lambda *a: gathers.append(1) or gather(*a))
    # float32 weights whatever the cache holds, as the decode attention passes them
    out = page_gather_cpu.weighted_pages_sum(v_cache, plan.page_ids, rows, weights)
    assert out.shape == (rows, 2, 3, 32) and out.dtype == torch.float32
    assert float((out - expected).abs().max()) <= 1e-4
    assert bool(gathers) == (layout == "bfloat16")
