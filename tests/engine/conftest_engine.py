"""Factories and fixtures of the serving-core tests (scheduler, runner, engine, LLM).

Fixtures here are registered through tests/engine/conftest.py. Expensive things are session-scoped
and built on the shared model fixtures there (``default_model``, ``tiny_hf_checkpoints``), so the
GGUF is loaded once by us and once by transformers per session.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.engine_config import EngineConfig
from engine.engine_core import LLMEngine
from engine.llm import LLM
from engine.loaders import LoadedModel, load_model
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_config import SchedulerConfig
from engine.scheduler_output import SchedulerOutput
from kvcache.manager import KVCacheManager
from kvcache.spec import PoolGroupSpec
from tests.oracle import hf_greedy  # noqa: F401 (re-exported for the engine tests)

GREEDY = SamplingParams(temperature=0.0)

SHARED_PREFIX = (
    "You are a careful assistant. Answer concisely and accurately, explain your reasoning "
    "step by step, and say so plainly when you do not know the answer. Question: "
)  # 34 SmolLM2 tokens: two full pages of 16
LONG_PROMPT = (
    "Paged attention splits the key and value cache of every sequence into fixed-size pages, "
    "so memory is allocated on demand and shared prefixes can be reused across requests. "
    "A scheduler decides every step which sequences run, how many prompt tokens each computes, "
    "and which request must be preempted when the pages run out. Chunked prefill bounds the "
    "latency of decode steps when long prompts arrive. Explain in simple words why this design "
    "improves the throughput of a serving system, and what trade-offs it makes."
)  # 102 SmolLM2 tokens: two prefill chunks of 64
PROMPTS = [
    "Hello",
    "The capital of France is",
    "Write a haiku about the ocean.",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Translate to French: Good morning, how are you today?",
    LONG_PROMPT,
    SHARED_PREFIX + "What is the boiling point of water at sea level?",
    SHARED_PREFIX + "Why is the sky blue?",
    SHARED_PREFIX + "How many legs does a spider have?",
]


def tiny_kv(
    num_pages: int = 17, page_size: int = 4, reuse_policy: str = "all_reusable"
) -> KVCacheManager:
    """A real KV cache manager over one layer, 1 kv head of dim 2 (``num_pages`` counts the null page)."""
    spec = PoolGroupSpec(
        "full", (0,), num_pages, page_size, num_kv_heads=1, head_dim=2, dtype=torch.float32
    )
    return KVCacheManager([spec], reuse_policy, "cpu")


def tiny_scheduler(kv: KVCacheManager, **limits: int) -> Scheduler:
    """A scheduler over ``kv`` with small default limits (override any SchedulerConfig field)."""
    fields = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "prefill_chunk_size": 64,
        "max_model_len": 128,
    }
    fields.update(limits)
    return Scheduler(SchedulerConfig(page_size=kv.page_size, **fields), kv)


def make_request(
    request_id: str,
    prompt: int | Sequence[int],
    eos: Sequence[int] = (),
    prefill_only: bool = False,
    **params: Any,
) -> Request:
    """A greedy request; ``prompt`` is a token list or a length (tokens 10, 11, ... so no EOS inside).
    ``eos[0]`` plays the tokenizer's EOS (it stops with no stop_reason)."""
    tokens = list(range(10, 10 + prompt)) if isinstance(prompt, int) else list(prompt)
    sp = SamplingParams(temperature=0.0, **params)
    return Request(
        request_id,
        tokens,
        sp,
        eos_token_ids=frozenset(eos),
        eos_token_id=eos[0] if eos else None,
        prefill_only=prefill_only,
    )


def run_step(
    scheduler: Scheduler, next_token: Callable[[Request], int] = lambda r: 7
) -> tuple[SchedulerOutput, list[Request]]:
    """One scheduler step without a model: each sampling request gets ``next_token(request)``."""
    out = scheduler.schedule()
    tokens = [next_token(r) for r, s in zip(out.requests, out.sample, strict=True) if s]
    return out, scheduler.update(out, tokens)


def assert_no_leak(kv: KVCacheManager) -> None:
    """Every page back in the free queue (cached ones may stay evictable) and the accounting sound."""
    kv.check_integrity()
    for name, group in kv.stats().groups.items():
        assert group.used == 0, f"{name}: {group.used} pages still held"
    assert kv.stats().num_requests == 0


# ---- fixtures ----
@pytest.fixture(scope="session")
def tiny_llama3_loaded(tiny_hf_checkpoints: dict[str, Path]) -> LoadedModel:
    """Our load of the tiny random Llama-3 checkpoint (has a tokenizer and a chat template)."""
    return load_model(str(tiny_hf_checkpoints["llama3"]))


@pytest.fixture
def make_tiny_engine(tiny_llama3_loaded: LoadedModel) -> Iterator[Callable[..., LLMEngine]]:
    """``make_tiny_engine(**EngineConfig fields)``: an engine with its own small KV cache over the
    shared tiny Llama-3; every engine's cache is checked for leaks at teardown."""
    made: list[LLMEngine] = []

    def factory(**kwargs: Any) -> LLMEngine:
        fields = {
            "num_pages": 64,
            "page_size": 4,
            "max_num_seqs": 8,
            "max_num_batched_tokens": 64,
            "prefill_chunk_size": 32,
            "max_model_len": 128,  # 32 pages: one request fits (the engine refuses to start else)
        }
        fields.update(kwargs)
        engine = LLMEngine.from_loaded(tiny_llama3_loaded, EngineConfig(model="tiny", **fields))
        made.append(engine)
        return engine

    yield factory
    for engine in made:
        if not engine.has_unfinished():
            engine.kv.check_integrity()


@pytest.fixture(scope="session")
def smollm_llm(default_model: LoadedModel) -> LLM:
    """LLM over the embedded SmolLM2 GGUF (float32, CPU) with a small prefill chunk (64 tokens)."""
    return LLM.from_loaded(
        default_model,
        page_size=16,
        num_pages=1024,
        max_num_seqs=64,
        max_num_batched_tokens=512,
        prefill_chunk_size=64,
        max_model_len=2048,
        max_stats_len=-1,
    )


@pytest.fixture(scope="session")
def smollm_eos(smollm_llm: LLM) -> list[int]:
    return sorted(smollm_llm.engine.eos_token_ids)


@pytest.fixture(scope="session")
def smollm_oracle(
    hf_gguf_model: Any, smollm_eos: list[int]
) -> Callable[[list[int], int], list[int]]:
    """``oracle(prompt_ids, max_new_tokens)``: transformers' greedy tokens on the embedded GGUF,
    one prompt at a time, memoized for the session."""
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def oracle(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in cache:
            cache[key] = hf_greedy(hf_gguf_model, prompt_ids, max_new_tokens, smollm_eos)
        return cache[key]

    return oracle
