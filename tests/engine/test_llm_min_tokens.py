"""min_tokens (vLLM's): EOS and stop token ids are masked until that many tokens are generated,
as transformers' min_new_tokens masks its EOS ids (the oracle, on the tiny random Llama-3). (Stop
strings and min_tokens: tests/engine/test_scheduler_stop_strings.py.)"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams

from .conftest_engine import assert_no_leak, hf_greedy

MAX_TOKENS = 12


def test_min_tokens_masks_the_stop_ids_as_transformers(
    tiny_hf_checkpoints: dict[str, Path],
) -> None:
    from transformers import AutoModelForCausalLM

    directory = tiny_hf_checkpoints["llama3"]
    llm = LLM(str(directory), page_size=4, num_pages=128)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    eos = sorted(llm.engine.eos_token_ids)
    prompts = [[0, 17, 42, 99, 3], [0, 250, 8], [0, *range(30, 50)]]
    free = llm.generate(
        prompts,
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    for prompt, out in zip(prompts, free, strict=True):
        stop = out.token_ids[2]  # greedy says it third: as a stop token, it ends the answer there
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop])
        (early,) = llm.generate([prompt], params, use_tqdm=False)
        assert len(early.token_ids) <= 3 and early.stop_reason == stop
        for min_tokens in (4, 8):
            masked = SamplingParams(
                temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop], min_tokens=min_tokens
            )
            (got,) = llm.generate([prompt], masked, use_tqdm=False)
            want = hf_greedy(hf, prompt, MAX_TOKENS, sorted({*eos, stop}), min_tokens)
            assert got.token_ids == want, (prompt, min_tokens)
            assert len(got.token_ids) >= min_tokens and stop not in got.token_ids[:min_tokens]
    assert_no_leak(llm.engine.kv)
