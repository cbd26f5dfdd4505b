"""Acceptance: LLM on the tiny random Llama-3 and Qwen3 HF checkpoints gives transformers' greedy tokens
(prompts of many lengths, one longer than the prefill chunk, a shared prefix; run as one batch)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams

from .conftest_engine import assert_no_leak, hf_greedy

MAX_TOKENS = 12
SHARED = [0, 11, 22, 33, 44, 55, 66, 77, 88, 99]  # 2.5 pages of 4 tokens


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    varied = [
        [0, *torch.randint(5, 300, (n,), generator=gen).tolist()] for n in (0, 2, 5, 9, 17, 40)
    ]
    return varied + [SHARED + [101, 102], SHARED + [150], SHARED + [7, 8, 9, 10, 11]]


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_greedy_equals_transformers(name: str, tiny_hf_checkpoints: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    directory = tiny_hf_checkpoints[name]
    llm = LLM(
        str(directory),
        page_size=4,
        num_pages=128,
        prefill_chunk_size=16,
        max_num_batched_tokens=48,
        max_num_seqs=8,
    )
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    eos = sorted(llm.engine.eos_token_ids)
    assert eos  # both sides stop at the same EOS ids
    batch = prompts()
    assert max(len(p) for p in batch) > 16
    outs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for prompt, out in zip(batch, outs, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, MAX_TOKENS, eos), prompt
    assert llm.engine.kv.stats().reuse_hit_tokens >= 2 * 8
    assert_no_leak(llm.engine.kv)
