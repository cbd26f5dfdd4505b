"""Gemma3ForCausalLM over a real paged KV buffer against transformers' Gemma 3 logits: a 5:1
sliding:full model with a window of 32, prompts past the window prefilled in chunks across its
edge, then decoded (as tests/engine/test_model_llama.py does for the Llama family)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine.loaders import load_model
from engine.model import Gemma3ForCausalLM

from .conftest import HYBRID_WINDOW, TINY_VOCAB, PagedKV
from .test_model_llama import assert_logits_match, paged_logits, reference_logits


def test_gemma3_logits_match_transformers(tiny_hybrid_checkpoints: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    directory = tiny_hybrid_checkpoints["gemma3"]
    loaded = load_model(str(directory))
    assert isinstance(loaded.model, Gemma3ForCausalLM)
    c = loaded.config
    assert [c.layer_window(i) for i in range(6)] == [HYBRID_WINDOW] * 5 + [None]
    hf_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(9)
    seqs = [torch.randint(0, TINY_VOCAB, (n,), generator=gen).tolist() for n in (100, 41)]
    kv = PagedKV.allocate(c, num_pages=30, page_size=8)
    pages = [[29, 3, 17, 8, 22, 1, 12, 25, 6, 14, 19, 27, 5], [4, 23, 11, 2, 16, 9]]
    ours = paged_logits(loaded.model, kv, seqs, splits=[45, 20], pages=pages)
    ref = reference_logits(hf_model, seqs)
    assert_logits_match(ours, ref, atol=1e-4)
    cap = c.final_logit_softcapping
    assert cap is not None and max(float(r.abs().max()) for r in ref) < cap  # capped


def test_gemma3_bfloat16_within_transformers_own_spread(
    tiny_hybrid_checkpoints: dict[str, Path],
) -> None:
    """bf16: Gemma's four norms per layer and scaled embeddings make rounding noise large, so the
    yardstick is transformers against itself (eager vs SDPA attention, same weights, same run)."""
    from transformers import AutoModelForCausalLM

    directory = tiny_hybrid_checkpoints["gemma3"]
    loaded = load_model(str(directory), dtype=torch.bfloat16)
    sdpa, eager = (
        AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.bfloat16, attn_implementation=impl
        ).eval()
        for impl in ("sdpa", "eager")
    )
    gen = torch.Generator().manual_seed(10)
    seqs = [torch.randint(0, TINY_VOCAB, (60,), generator=gen).tolist()]
    kv = PagedKV.allocate(loaded.config, num_pages=12, page_size=8, dtype=torch.bfloat16)
    (ours,) = paged_logits(loaded.model, kv, seqs, splits=[37], pages=[[3, 9, 1, 7, 11, 5, 2, 8]])
    (ref,), (other,) = reference_logits(sdpa, seqs), reference_logits(eager, seqs)
    spread = float((other - ref).abs().max())
    assert 0 < float((ours - ref).abs().max()) <= 1.5 * spread


def test_attention_soft_capping_matches_transformers_eager(
    tiny_hybrid_checkpoints: dict[str, Path],
) -> None:
    """Gemma 3 configs leave attn_logit_softcapping null (and transformers' Gemma 3 would not apply
    it), so the oracle is transformers' eager attention with the cap passed through every layer,
    as Gemma 2 does; ours takes it from ModelConfig."""
    from transformers import AutoModelForCausalLM

    directory = tiny_hybrid_checkpoints["gemma3"]
    loaded = load_model(str(directory))
    capped = dataclasses.replace(loaded.config, attn_logit_softcapping=0.5)
    model = Gemma3ForCausalLM.build(capped, torch.float32, "cpu")
    model.load_state_dict(loaded.model.state_dict())
    hf_model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    seq = torch.randint(0, TINY_VOCAB, (50,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        plain = hf_model(torch.tensor([seq])).logits[0]
        ref = hf_model(torch.tensor([seq]), softcap=0.5).logits[0]
    assert float((plain - ref).abs().max()) > 1.0  # the cap bites
    kv = PagedKV.allocate(capped, num_pages=12, page_size=8)
    ours = paged_logits(model, kv, [seq], splits=[20], pages=[[3, 9, 1, 7, 11, 5, 2]])
    assert_logits_match(ours, [ref], atol=1e-4)


def test_gemma3_rejects_a_llama_config(tiny_hybrid_checkpoints: dict[str, Path]) -> None:
    llama = load_model(str(tiny_hybrid_checkpoints["mistral_swa"])).config
    with pytest.raises(ValueError, match="gemma3_text"):
        Gemma3ForCausalLM(llama)
