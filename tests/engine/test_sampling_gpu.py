"""The sampler's penalties, min_p, logit_bias, logprobs and prompt logprobs on a GPU (CUDA graphs
on): the same tokens and log probabilities as the CPU engine, which
tests/engine/test_llm_penalties.py, test_llm_logprobs.py and test_llm_prompt_logprobs.py check
against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [[0, 17, 42, 99, 3], [0, 250, 8], [0, *range(30, 50)], [0, 5, 5, 5, 5, 6]]


def test_penalties_min_p_and_logprobs_on_the_gpu_are_the_cpus(
    tiny_hf_checkpoints: dict[str, Path],
) -> None:
    directory = str(tiny_hf_checkpoints["llama3"])
    params = [
        SamplingParams(
            temperature=0, max_tokens=10, repetition_penalty=1.3, logprobs=3, prompt_logprobs=2
        ),
        SamplingParams(
            temperature=0,
            max_tokens=10,
            presence_penalty=0.5,
            frequency_penalty=1.0,
            logit_bias={5: 3.0, 9: -100.0},
        ),
        SamplingParams(temperature=1.0, seed=2, max_tokens=10, min_p=1.0, logprobs=1),
        SamplingParams(temperature=0, max_tokens=10, logprobs=0, n=2, allowed_token_ids=[3, 9, 77]),
    ]
    cpu = LLM(directory, page_size=4, num_pages=128).generate(PROMPTS, params, use_tqdm=False)
    gpu = LLM(directory, device="cuda", page_size=4, num_pages=128).generate(
        PROMPTS, params, use_tqdm=False
    )
    for c, g in zip(cpu, gpu, strict=True):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in c.outputs]
        assert (c.prompt_logprobs is None) == (g.prompt_logprobs is None)
        for cp, gp in zip(c.prompt_logprobs or [], g.prompt_logprobs or [], strict=True):
            assert (cp is None) == (gp is None)
            if cp is not None:
                assert cp.keys() == gp.keys()
                assert all(gp[t].logprob == pytest.approx(cp[t].logprob, abs=1e-3) for t in cp)
        for co, go in zip(c.outputs, g.outputs, strict=True):
            assert (co.logprobs is None) == (go.logprobs is None)
            for cp, gp in zip(co.logprobs or [], go.logprobs or [], strict=True):
                assert cp.keys() == gp.keys()
                for t in cp:
                    assert gp[t].logprob == pytest.approx(cp[t].logprob, abs=1e-3)
                    assert gp[t].rank == cp[t].rank
