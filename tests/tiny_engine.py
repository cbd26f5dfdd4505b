"""A real engine on tiny random weights (no checkpoint, no tokenizer), for the worker tests."""

from __future__ import annotations

from engine.engine_config import EngineConfig
from engine.engine_core import LLMEngine
from engine.sampling_params import SamplingParams

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 512,
}
PAGE = 4


PAGE_BYTES = 2 * 2 * PAGE * 2 * 16 * 4  # layers, key/value, tokens, kv heads, head dim, float32


def tiny_engine(num_pages: int, host_pages: int = 0, seed: int = 0) -> LLMEngine:
    """An engine of ``num_pages`` pages (the null page included); its max_model_len is what they
    hold, up to 256 (an engine refuses to start when one longest request cannot fit). With
    ``host_pages``, a KV host tier of that many pages beneath them; ``seed`` draws its weights."""
    cfg = EngineConfig(
        load_format="dummy",
        dummy_config=TINY,
        num_pages=num_pages,
        page_size=PAGE,
        max_model_len=min(256, (num_pages - 1) * PAGE),
        host_tier_bytes=host_pages * PAGE_BYTES,
        seed=seed,
    )
    return LLMEngine.from_config(cfg)


def tiny_hybrid_engine(num_pages: int, prefill_chunk_size: int = 24) -> LLMEngine:
    """A tiny Gemma 3 (5 sliding layers, a window of 32 tokens : 1 full layer) on random weights
    (the same on every call), pool groups "full" and "swa_32" of ``num_pages`` pages each, prompts
    prefilled in chunks of ``prefill_chunk_size`` tokens, pages kept for prefix reuse."""
    from tests.engine.conftest import HYBRID_HF_CONFIGS

    cfg = EngineConfig(
        load_format="dummy",
        dummy_config=HYBRID_HF_CONFIGS["gemma3"],
        num_pages=num_pages,
        page_size=PAGE,
        max_model_len=128,
        prefill_chunk_size=prefill_chunk_size,
        reuse_policy="all_reusable",
    )
    return LLMEngine.from_config(cfg)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
