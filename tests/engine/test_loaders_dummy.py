"""Dummy load format: seeded random weights of any shape, finite outputs, presets."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from engine.loaders import DUMMY_PRESETS, LoadedModel, load_model
from engine.model_config import ModelConfig

from .conftest import PagedKV

DEEP = ModelConfig(
    architecture="qwen3",
    vocab_size=512,
    hidden_size=256,
    num_layers=12,
    num_heads=8,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=512,
    qk_norm=True,
    tie_word_embeddings=True,
)


def _logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    kv = PagedKV.allocate(
        loaded.config, num_pages=4, page_size=8, dtype=next(loaded.model.parameters()).dtype
    )
    batch = kv.batch([(ids, 0, [2, 3])])
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(batch, kv.layer_caches()))


def test_seeded_and_finite() -> None:
    a = load_model(load_format="dummy", dummy_config=DEEP, seed=5)
    b = load_model(load_format="dummy", dummy_config=DEEP, seed=5)
    c = load_model(load_format="dummy", dummy_config=DEEP, seed=6)
    assert (a.name, a.tokenizer, a.config) == ("dummy", None, DEEP)
    for (name, pa), pb, pc in zip(
        a.model.named_parameters(), b.model.parameters(), c.model.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        assert name.endswith("norm.weight") or not torch.equal(pa, pc), name
    logits = _logits(a, list(range(1, 12)))
    assert logits.shape == (11, 512) and torch.isfinite(logits).all()
    assert logits.std() > 0


def test_bfloat16_and_dict_configs() -> None:
    hf_style = {
        "model_type": "llama",
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
    }
    loaded = load_model("bench", load_format="dummy", dummy_config=hf_style, dtype=torch.bfloat16)
    assert loaded.name == "bench" and loaded.config == ModelConfig.from_hf_config(hf_style)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert torch.isfinite(_logits(loaded, [5, 6, 7])).all()
    fields = load_model(load_format="dummy", dummy_config=dataclasses.asdict(DEEP))
    assert fields.config == DEEP


def test_dummy_weights_in_the_shape_of_a_checkpoint(tiny_llama3_dir: Path) -> None:
    real = load_model(str(tiny_llama3_dir))
    loaded = load_model(str(tiny_llama3_dir), load_format="dummy", seed=1)
    assert loaded.config == real.config and loaded.name == "llama3"
    assert loaded.tokenizer is not None and loaded.tokenizer.stop_token_ids == (1, 4)
    ours = loaded.model.model.embed_tokens.weight
    assert not torch.equal(ours, real.model.model.embed_tokens.weight)
    assert abs(ours.std().item() - 0.02) < 2e-3


def test_presets() -> None:
    llama = DUMMY_PRESETS["llama-3.1-8b"]
    assert (llama.num_layers, llama.num_heads, llama.num_kv_heads, llama.head_dim) == (
        32,
        32,
        8,
        128,
    )
    assert llama.rope_scaling is not None and llama.rope_scaling.factor == 8.0
    assert DUMMY_PRESETS["qwen3-8b"].qk_norm and DUMMY_PRESETS["llama-3-8b"].rope_scaling is None


def test_gemma3_dummy_norms_are_the_identity_scale() -> None:
    from engine.model import Gemma3ForCausalLM

    from .conftest import HYBRID_HF_CONFIGS

    loaded = load_model(load_format="dummy", dummy_config=HYBRID_HF_CONFIGS["gemma3"], seed=2)
    assert isinstance(loaded.model, Gemma3ForCausalLM)
    params = dict(loaded.model.named_parameters())
    norms = [n for n in params if n.endswith("norm.weight")]
    assert len(norms) == 6 * 6 + 1  # four per layer, q/k norms, the final norm
    assert all(not params[n].any() for n in norms)  # (1 + w): w = 0 leaves the input unscaled
    assert params["model.layers.0.self_attn.qkv_proj.weight"].std() > 0.01
    groups = sorted({loaded.config.kv_group(i) for i in range(loaded.config.num_layers)})
    kv = PagedKV.allocate(loaded.config, num_pages=4, page_size=8)
    with torch.inference_mode():
        hidden = loaded.model(kv.batch([(list(range(9)), 0, [2, 3])], groups), kv.layer_caches())
        assert torch.isfinite(loaded.model.compute_logits(hidden)).all()
