"""Acceptance: LLM on tiny random hybrid checkpoints (sliding-window layers, a window of 32 tokens)
gives transformers' greedy tokens: Gemma 3 (5 sliding : 1 full), Qwen3 with use_sliding_window, and
Mistral (every layer slides). Prompts up to several windows long in one batch of 32, prefilled in
chunks that cross window edges; prefix hits from shared prompts and later turns; preemption under
a small page budget; SWA scratch reuse. The window groups really release pages (their page counts
stay near a window's), and every cache checks out at the end.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

from .conftest import HYBRID_WINDOW, TINY_VOCAB
from .conftest_engine import assert_no_leak, hf_greedy

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
NAMES = ["gemma3", "qwen3_swa", "mistral_swa"]
BASE = {
    "page_size": 8,
    "max_model_len": 256,
    "max_num_seqs": 32,
    "max_num_batched_tokens": 160,
    "prefill_chunk_size": 24,  # chunks end inside windows, then cross their edges
}


def prompts() -> list[list[int]]:
    """32 prompts: lengths 1 to 5 windows, and 12 sharing a 70-token prefix (over two windows)."""
    gen = torch.Generator().manual_seed(25)

    def rand(n: int) -> list[int]:
        return torch.randint(5, TINY_VOCAB, (n,), generator=gen).tolist()

    lengths = [1, 7, 24, 31, 32, 33, 40, 47, 64, 65, 80, 97, 111, 128, 140, 150, 160, 3, 58, 72]
    shared = rand(70)
    return [rand(n) for n in lengths] + [shared + rand(k) for k in range(1, 13)]


class Oracle:
    """transformers' greedy continuations, computed once per checkpoint and prompt."""

    def __init__(self, checkpoints: dict[str, Path]) -> None:
        self.checkpoints = checkpoints
        self._models: dict[str, object] = {}
        self._outputs: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def __call__(self, name: str, prompt: list[int], eos: list[int]) -> list[int]:
        from transformers import AutoModelForCausalLM

        key = (name, tuple(prompt))
        if key not in self._outputs:
            if name not in self._models:
                self._models[name] = AutoModelForCausalLM.from_pretrained(
                    self.checkpoints[name], dtype=torch.float32
                ).eval()
            self._outputs[key] = hf_greedy(self._models[name], prompt, MAX_TOKENS, eos)
        return self._outputs[key]


@pytest.fixture(scope="module")
def oracle(tiny_hybrid_checkpoints: dict[str, Path]) -> Oracle:
    return Oracle(tiny_hybrid_checkpoints)


def check(llm: LLM, name: str, oracle: Oracle, batch: list[list[int]]) -> list[RequestOutput]:
    outs = llm.generate(batch, GREEDY)
    eos = sorted(llm.engine.eos_token_ids)
    for prompt, out in zip(batch, outs, strict=True):
        assert out.error is None, out.error
        assert out.token_ids == oracle(name, prompt, eos), (name, len(prompt))
    return outs


@pytest.mark.parametrize("name", NAMES)
def test_greedy_equals_transformers_with_prefix_hits(
    name: str, tiny_hybrid_checkpoints: dict[str, Path], oracle: Oracle
) -> None:
    llm = LLM(str(tiny_hybrid_checkpoints[name]), num_pages=200, **BASE)
    kv = llm.engine.kv
    windows = {g: s.sliding_window for g, s in kv.specs.items()}
    assert f"swa_{HYBRID_WINDOW}" in windows and ("full" in windows) == (name != "mistral_swa")
    batch = prompts()
    outs = check(llm, name, oracle, batch)
    first = kv.stats()
    assert first.reuse_hit_tokens >= 8 * 8  # the shared 70-token prefix: 8 pages per later prompt
    window = first.groups[f"swa_{HYBRID_WINDOW}"]
    # A request never held more than (window + chunk) worth of window pages; 32 of them at once
    # stay far below what full attention would hold (every prompt's pages).
    per_request = kv.max_pages_per_request(256, BASE["prefill_chunk_size"])[f"swa_{HYBRID_WINDOW}"]
    assert window.peak_used <= 32 * per_request < sum(-(-len(p) // 8) for p in batch)
    assert window.evictable > 0  # released pages stayed cached
    # Later turns: each whole earlier conversation plus a new message hits its cached pages.
    turns = [p + o.token_ids + [7, 8, 9] for p, o in zip(batch[10:20], outs[10:20], strict=True)]
    before = kv.stats().reuse_hit_tokens
    check(llm, name, oracle, turns)
    assert kv.stats().reuse_hit_tokens - before >= sum((len(t) - 12) // 8 * 8 for t in turns)
    assert_no_leak(kv)


@pytest.mark.parametrize("name", NAMES)
def test_preemption_under_a_small_budget_keeps_tokens(
    name: str, tiny_hybrid_checkpoints: dict[str, Path], oracle: Oracle
) -> None:
    # Room for about two longest requests per group (split by what one request holds in each).
    directory = str(tiny_hybrid_checkpoints[name])
    probe = LLM(directory, num_pages=200, **BASE).engine.kv
    need = probe.max_pages_per_request(256, BASE["prefill_chunk_size"])
    budget = sum(2 * (need[g] + 1) * s.page_bytes for g, s in probe.specs.items())
    llm = LLM(directory, kv_cache_memory_bytes=budget, max_stats_len=-1, **BASE)
    check(llm, name, oracle, prompts())
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leak(llm.engine.kv)


@pytest.mark.parametrize("name", ["gemma3", "mistral_swa"])
def test_scratch_reuse_keeps_tokens_and_leaves_no_trail(
    name: str, tiny_hybrid_checkpoints: dict[str, Path], oracle: Oracle
) -> None:
    directory = str(tiny_hybrid_checkpoints[name])
    group = f"swa_{HYBRID_WINDOW}"
    long_prompts = [p for p in prompts() if len(p) > 3 * HYBRID_WINDOW]
    trails = {}
    for scratch in (False, True):
        llm = LLM(directory, num_pages=200, swa_scratch_reuse=scratch, **BASE)
        check(llm, name, oracle, long_prompts)
        trails[scratch] = llm.engine.kv.stats().groups[group].evictable
        assert_no_leak(llm.engine.kv)
    # Without scratch reuse every page that left a window stays cached; with it only the last
    # window of each prompt (and what decode added) does.
    assert trails[True] < trails[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", NAMES)
def test_greedy_equals_transformers_on_gpu(
    name: str, tiny_hybrid_checkpoints: dict[str, Path], oracle: Oracle
) -> None:
    """The Triton kernels read window groups whose released positions show the null page."""
    llm = LLM(str(tiny_hybrid_checkpoints[name]), device="cuda", num_pages=200, **BASE)
    check(llm, name, oracle, prompts())
    assert llm.engine.kv.stats().groups[f"swa_{HYBRID_WINDOW}"].evictable > 0
    assert_no_leak(llm.engine.kv)
