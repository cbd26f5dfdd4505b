"""Shared fixtures of the engine tests: tiny HF checkpoints, the embedded GGUF, transformers oracles,
and a paged KV buffer laid out as kvcache/spec.py says, with a ForwardBatch builder.

Everything expensive is session-scoped: transformers loads the GGUF once (about 15 s), our loader once.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.forward_batch import ForwardBatch
from engine.model_config import ModelConfig
from kvcache.kv_buffer import layer_view

TINY_VOCAB = 320  # the tiny tokenizer has fewer ids; the rest are valid ids without text

TINY_SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

# A Llama-3 style template spread over lines, so trim_blocks/lstrip_blocks matter.
TINY_CHAT_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    <|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message['content'] | trim }}<|eot_id|>
{% endfor %}
{% if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

_TOKENIZER_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello tokenizer!",
    "Paged attention stores keys and values in fixed-size pages; decode reads them back.",
    "Numbers 0123456789 and symbols: {}[]()<>=+-*/ and naïve café, Grüße, 日本語, 😀.",
]

TINY_HF_CONFIGS: dict[str, dict[str, Any]] = {
    "llama3": {
        "model_type": "llama",
        "vocab_size": TINY_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": [1, 4],
        "rope_theta": 500000.0,
        # original length 64 puts the 16-dim head's frequencies in all three llama3 bands
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "qwen3": {
        "model_type": "qwen3",
        "vocab_size": TINY_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
    "qwen2": {
        "model_type": "qwen2",
        "vocab_size": TINY_VOCAB,
        "hidden_size": 48,
        "intermediate_size": 80,
        "num_hidden_layers": 3,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
}


# Hybrid models: sliding-window layers (a window of 32 tokens) next to full-attention ones.
HYBRID_WINDOW = 32
HYBRID_HF_CONFIGS: dict[str, dict[str, Any]] = {
    "gemma3": {  # 5 sliding : 1 full, as Gemma 3 (the default sliding_window_pattern of 6)
        "model_type": "gemma3_text",
        "vocab_size": TINY_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": HYBRID_WINDOW,
        "max_position_embeddings": 512,
        "query_pre_attn_scalar": 24,  # not head_dim: the scale must come from it
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},  # full layers only
        "final_logit_softcapping": 10.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
    "qwen3_swa": {  # layer 0 full, layers 1 and 2 sliding (max_window_layers=1)
        "model_type": "qwen3",
        "vocab_size": TINY_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "use_sliding_window": True,
        "sliding_window": HYBRID_WINDOW,
        "max_window_layers": 1,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
    "mistral_swa": {  # every layer slides: one window group, no full group
        "model_type": "mistral",
        "vocab_size": TINY_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": HYBRID_WINDOW,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
}


def _write_tiny_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=TINY_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_TOKENIZER_CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    assert tok.get_vocab_size() <= TINY_VOCAB and tok.token_to_id("<|begin_of_text|>") == 0
    tok.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "chat_template": TINY_CHAT_TEMPLATE,
        # the older AddedToken-dict spelling of a special token, as many Hub checkpoints still have it
        "eos_token": {
            "__type": "AddedToken",
            "content": "<|end_of_text|>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        },
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4]}))


@torch.no_grad()
def write_tiny_checkpoint(
    directory: Path, hf_config: dict[str, Any], seed: int, **save_kwargs: Any
) -> Path:
    """A random transformers model saved with save_pretrained, plus the tiny tokenizer.

    Every parameter is random (norm weights around 1, biases non-zero), so a wrong mapping of any
    tensor shows in the logits.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in hf_config.items() if k != "model_type"}
    config = AutoConfig.for_model(hf_config["model_type"], **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.2 * torch.randn_like(param))
        else:
            param.copy_(0.15 * torch.randn_like(param))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, **save_kwargs)
    _write_tiny_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_hf_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Directories of tiny random HF checkpoints: "llama3" (llama3 rope scaling, eos list),
    "qwen3" (q/k norm, head_dim != hidden/heads, tied embeddings), "qwen2" (q/k/v bias)."""
    root = tmp_path_factory.mktemp("tiny_hf")
    return {
        name: write_tiny_checkpoint(root / name, cfg, seed=i)
        for i, (name, cfg) in enumerate(TINY_HF_CONFIGS.items())
    }


@pytest.fixture(scope="session")
def tiny_hybrid_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random HF checkpoints with sliding-window layers (HYBRID_HF_CONFIGS)."""
    root = tmp_path_factory.mktemp("tiny_hybrid")
    return {
        name: write_tiny_checkpoint(root / name, cfg, seed=10 + i)
        for i, (name, cfg) in enumerate(HYBRID_HF_CONFIGS.items())
    }


@pytest.fixture(scope="session")
def tiny_llama3_dir(tiny_hf_checkpoints: dict[str, Path]) -> Path:
    return tiny_hf_checkpoints["llama3"]


@dataclass
class PagedKV:
    """A real paged KV buffer [num_pages, Hkv, num_layers, 2, page_size, D] (kvcache/spec.py) and
    batch building over it."""

    buffer: torch.Tensor
    page_size: int

    @classmethod
    def allocate(
        cls, config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype = torch.float32
    ) -> PagedKV:
        shape = (num_pages, config.num_kv_heads, config.num_layers, 2, page_size, config.head_dim)
        # Large random garbage: attending to a slot nobody wrote shows up in the logits. (Not NaN:
        # the reference decode kernel multiplies masked slots by probability 0, and 0 * NaN = NaN.)
        gen = torch.Generator().manual_seed(1234)
        return cls((100.0 * torch.randn(shape, generator=gen)).to(dtype), page_size)

    def layer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [layer_view(self.buffer, layer) for layer in range(self.buffer.shape[2])]

    def batch(
        self,
        steps: Sequence[tuple[Sequence[int], int, Sequence[int]]],
        groups: Sequence[str] = ("full",),
    ) -> ForwardBatch:
        """One ForwardBatch from (new token ids, tokens already cached, page ids) per sequence;
        every row is sampled. All layers share this one buffer, so every pool group the model's
        layers name (``groups``) gets the same page table and slots (windows release nothing)."""
        ids, positions, slots, lens, cu = [], [], [], [], [0]
        max_pages = max(len(pages) for _, _, pages in steps)
        table = torch.zeros(len(steps), max_pages, dtype=torch.int32)  # padded with the null page
        for b, (new_ids, cached, pages) in enumerate(steps):
            assert cached + len(new_ids) <= len(pages) * self.page_size, "not enough pages"
            ids += list(new_ids)
            for pos in range(cached, cached + len(new_ids)):
                positions.append(pos)
                slots.append(pages[pos // self.page_size] * self.page_size + pos % self.page_size)
            lens.append(cached + len(new_ids))
            cu.append(cu[-1] + len(new_ids))
            table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mappings=dict.fromkeys(groups, torch.tensor(slots, dtype=torch.int64)),
            page_tables=dict.fromkeys(groups, table),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            max_query_len=max(len(new_ids) for new_ids, _, _ in steps),
            logits_indices=torch.arange(len(ids), dtype=torch.int64),
        )


@pytest.fixture
def paged_kv() -> type[PagedKV]:
    """The PagedKV factory (``paged_kv.allocate(config, num_pages, page_size)``)."""
    return PagedKV


# ---- serving-core fixtures (scheduler, runner, engine, LLM), defined in conftest_engine.py ----
from .conftest_engine import (  # noqa: E402,F401
    make_tiny_engine,
    smollm_eos,
    smollm_llm,
    smollm_oracle,
    tiny_llama3_loaded,
)
