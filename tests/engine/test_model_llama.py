"""LlamaForCausalLM over a real paged KV buffer against transformers' logits on the same tokens.

Two sequences share each step: a prompt prefilled in two chunks (the second chunk attends to the
first through the pages), then three decode steps; pages are non-contiguous and differ per sequence.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.loaders import LoadedModel, load_model
from engine.model import PagedCausalLMBase

from .conftest import HYBRID_WINDOW, TINY_VOCAB, PagedKV

NUM_DECODE = 3


def paged_logits(
    model: PagedCausalLMBase,
    kv: PagedKV,
    seqs: list[list[int]],
    splits: list[int],
    pages: list[list[int]],
) -> list[torch.Tensor]:
    """Logits [len(seq), vocab] per sequence: chunk [0, split), chunk [split, prompt_len), then decode steps."""
    prompt_lens = [len(s) - NUM_DECODE for s in seqs]
    groups = sorted({model.config.kv_group(i) for i in range(model.config.num_layers)})
    rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    caches = kv.layer_caches()
    steps: list[list[tuple[int, int]]] = [
        [(0, split) for split in splits],
        [(split, plen) for split, plen in zip(splits, prompt_lens, strict=True)],
        *[[(plen + i, plen + i + 1) for plen in prompt_lens] for i in range(NUM_DECODE)],
    ]
    with torch.inference_mode():
        for step in steps:
            batch = kv.batch(
                [(seq[a:b], a, pg) for seq, (a, b), pg in zip(seqs, step, pages, strict=True)],
                groups,
            )
            assert batch.is_decode_only == all(b - a == 1 for a, b in step)
            logits = model.compute_logits(model(batch, caches), batch.logits_indices)
            assert logits.dtype == torch.float32
            for i, part in enumerate(logits.split([b - a for a, b in step])):
                rows[i].append(part)
    return [torch.cat(r) for r in rows]


def reference_logits(hf_model: Any, seqs: list[list[int]]) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [hf_model(torch.tensor([seq])).logits[0].float() for seq in seqs]


def assert_logits_match(ours: list[torch.Tensor], ref: list[torch.Tensor], atol: float) -> None:
    for got, want in zip(ours, ref, strict=True):
        assert got.shape == want.shape
        assert torch.isfinite(got).all()
        assert (got - want).abs().max().item() < atol
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("name", ["llama3", "qwen3", "qwen2"])
def test_tiny_checkpoint_logits_match_transformers(
    name: str, tiny_hf_checkpoints: dict[str, Path]
) -> None:
    from transformers import AutoModelForCausalLM

    directory = tiny_hf_checkpoints[name]
    loaded = load_model(str(directory))
    hf_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, TINY_VOCAB, (n,), generator=gen).tolist() for n in (14, 9)]
    kv = PagedKV.allocate(loaded.config, num_pages=12, page_size=4)
    ours = paged_logits(loaded.model, kv, seqs, splits=[6, 5], pages=[[7, 2, 9, 4], [3, 11, 5]])
    assert_logits_match(ours, reference_logits(hf_model, seqs), atol=1e-4)


@pytest.mark.parametrize("name", ["qwen3_swa", "mistral_swa"])
def test_sliding_window_logits_match_transformers(
    name: str, tiny_hybrid_checkpoints: dict[str, Path]
) -> None:
    """Prompts past the window, prefilled in two chunks across its edge, then decoded."""
    from transformers import AutoModelForCausalLM

    directory = tiny_hybrid_checkpoints[name]
    loaded = load_model(str(directory))
    hf_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(8)
    seqs = [torch.randint(0, TINY_VOCAB, (n,), generator=gen).tolist() for n in (90, 45)]
    assert min(len(s) for s in seqs) > HYBRID_WINDOW
    kv = PagedKV.allocate(loaded.config, num_pages=30, page_size=8)
    pages = [[29, 3, 17, 8, 22, 1, 12, 25, 6, 14, 19, 27], [4, 23, 11, 2, 16, 9, 28]]
    ours = paged_logits(loaded.model, kv, seqs, splits=[40, 20], pages=pages)
    assert_logits_match(ours, reference_logits(hf_model, seqs), atol=1e-4)
    # the window matters: without it the logits past the window differ
    assert loaded.config.layer_window(1) == HYBRID_WINDOW


def test_gguf_logits_match_transformers(default_model: LoadedModel, hf_gguf_model: Any) -> None:
    tok = default_model.tokenizer
    assert tok is not None
    first = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    second = tok.encode("Paged attention keeps keys and values in pages.")
    # The decode tokens are fixed ones, so both models see exactly the same sequence.
    seqs = [
        first + tok.encode("The capital is Paris.")[:NUM_DECODE],
        second + tok.encode(" It is fast.")[:NUM_DECODE],
    ]
    kv = PagedKV.allocate(default_model.config, num_pages=16, page_size=8)
    ours = paged_logits(
        default_model.model, kv, seqs, splits=[13, 4], pages=[[9, 3, 14, 6, 1, 11], [5, 12, 2, 8]]
    )
    assert_logits_match(ours, reference_logits(hf_gguf_model, seqs), atol=1e-3)


def test_compute_logits_selects_rows(tiny_hf_checkpoints: dict[str, Path]) -> None:
    loaded = load_model(str(tiny_hf_checkpoints["qwen2"]))
    hidden = torch.randn(5, loaded.config.hidden_size)
    all_rows = loaded.model.compute_logits(hidden)
    picked = loaded.model.compute_logits(hidden, torch.tensor([4, 1]))
    assert picked.shape == (2, TINY_VOCAB)
    # Same rows; a matmul over 2 rows may round differently from one over 5.
    torch.testing.assert_close(picked, all_rows[[4, 1]], rtol=0, atol=1e-5)


def test_load_weights_rejects_unknown_and_missing_tensors(
    tiny_hf_checkpoints: dict[str, Path],
) -> None:
    loaded = load_model(str(tiny_hf_checkpoints["llama3"]))
    model = loaded.model
    with pytest.raises(ValueError, match="model.layers.0.self_attn.rope_scale"):
        model.load_weights([("model.layers.0.self_attn.rope_scale", torch.zeros(1))])
    with pytest.raises(ValueError, match="parameters missing"):
        model.load_weights([("model.norm.weight", torch.ones(64))])
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("model.norm.weight", torch.ones(65))], strict=False)
    with pytest.raises(ValueError, match="shard 1"):
        model.load_weights(
            [("model.layers.1.self_attn.k_proj.weight", torch.ones(64, 64))], strict=False
        )


def test_forward_checks_layer_count(default_model: LoadedModel) -> None:
    kv = PagedKV.allocate(default_model.config, num_pages=2, page_size=4)
    batch = kv.batch([([1, 2], 0, [1])])
    with pytest.raises(ValueError, match="29 layer caches for a model of 30 layers"):
        default_model.model(batch, kv.layer_caches()[:29])
