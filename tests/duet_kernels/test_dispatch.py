"""duet_kernels/__init__ dispatch (Triton on CUDA or when asked, the reference when asked, else the CPU
path) and the Triton wrappers' argument checks, which fail before any launch."""

from __future__ import annotations

import pytest
import torch

import duet_kernels
from duet_kernels.checks import check_head_dim
from tests.duet_kernels.paged_inputs import make_paged_kv


def test_use_triton_follows_device_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.empty(1)
    monkeypatch.delenv("DUET_KERNELS", raising=False)
    assert not duet_kernels.use_triton(cpu)
    monkeypatch.setenv("DUET_KERNELS", "triton")
    assert duet_kernels.use_triton(cpu)
    monkeypatch.setenv("DUET_KERNELS", "ref")
    assert not duet_kernels.use_triton(cpu)


def test_cpu_call_runs_the_cpu_path_and_ref_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DUET_KERNELS", raising=False)
    gen = torch.Generator().manual_seed(0)
    kv = make_paged_kv([7, 3], 4, 2, 16, torch.float32, gen)
    q = torch.randn((2, 4, 16), generator=gen)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, 0.25)
    assert torch.equal(
        duet_kernels.paged_decode_attention(*args), duet_kernels.paged_decode_attention_cpu(*args)
    )
    monkeypatch.setenv("DUET_KERNELS", "ref")
    assert torch.equal(
        duet_kernels.paged_decode_attention(*args), duet_kernels.paged_decode_attention_ref(*args)
    )


@pytest.mark.parametrize("head_dim", [64, 128, 16, 256])
def test_power_of_two_head_dims_are_accepted(head_dim: int) -> None:
    check_head_dim(head_dim)


@pytest.mark.parametrize("head_dim", [96, 80, 8, 512])
def test_other_head_dims_are_rejected_with_the_reason(head_dim: int) -> None:
    with pytest.raises(ValueError, match=rf"head_dim must be a power of two .* got {head_dim}"):
        check_head_dim(head_dim)


def test_triton_wrappers_reject_bad_shapes_before_launch() -> None:
    from duet_kernels.decode_attention_triton import paged_decode_attention
    from duet_kernels.prefill_attention_triton import paged_prefill_attention

    gen = torch.Generator().manual_seed(0)
    kv = make_paged_kv([7], 4, 2, 96, torch.float32, gen)
    q = torch.randn((1, 4, 96), generator=gen)
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, 0.1)
    kv = make_paged_kv([7], 4, 2, 64, torch.float32, gen)
    q = torch.randn((1, 3, 64), generator=gen)  # 3 q heads over 2 kv heads
    with pytest.raises(
        ValueError, match=r"num_q_heads \(3\) must be a multiple of num_kv_heads \(2\)"
    ):
        paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, 0.1)
    q = torch.randn((7, 4, 64), generator=gen)
    with pytest.raises(ValueError, match="cu_seqlens_q must have B \\+ 1 = 2 entries"):
        paged_prefill_attention(
            q, kv.k_cache, kv.v_cache, kv.page_table, torch.tensor([0, 3, 7]), kv.seq_lens, 0.1
        )
