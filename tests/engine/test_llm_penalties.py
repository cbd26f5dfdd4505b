"""vLLM's penalties and min_p (engine/penalties.py), logit_bias and allowed_token_ids (the sampler),
greedy against transformers on the tiny random Llama 3: repetition_penalty, logit_bias and
allowed_token_ids as transformers' own processors, presence and frequency as OpenAI defines them
(tests/oracle.py), each row of a batch with its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.oracle import hf_greedy, openai_penalized_greedy

from .conftest_engine import assert_no_leak

MAX_TOKENS = 12
PROMPTS = [[0, 17, 42, 99, 3], [0, 250, 8], [0, *range(30, 50)], [0, 5, 5, 5, 5, 6]]


@pytest.fixture(scope="module")
def models(tiny_hf_checkpoints: dict[str, Path]) -> tuple[LLM, object]:
    from transformers import AutoModelForCausalLM

    directory = tiny_hf_checkpoints["llama3"]
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return LLM(str(directory), page_size=4, num_pages=128), hf


def greedy(**penalties: float) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **penalties)


def test_repetition_penalty_is_transformers(models) -> None:
    llm, hf = models
    eos = sorted(llm.engine.eos_token_ids)
    # One batch, each row with its own penalty (1.0: none; below 1 favours repeats).
    penalties = [1.0, 1.3, 2.0, 0.7]
    outs = llm.generate(PROMPTS, [greedy(repetition_penalty=r) for r in penalties], use_tqdm=False)
    plain = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    for prompt, r, out, free in zip(PROMPTS, penalties, outs, plain, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, MAX_TOKENS, eos, repetition_penalty=r)
        if r == 1.0:
            assert out.token_ids == free.token_ids
    changed = [o.token_ids != f.token_ids for o, f in zip(outs, plain, strict=True)]
    assert sum(changed) >= 2  # (the penalties changed the answers)
    assert_no_leak(llm.engine.kv)


def test_presence_and_frequency_penalties_as_openai_defines_them(models) -> None:
    llm, hf = models
    eos = sorted(llm.engine.eos_token_ids)
    cases = [(1.5, 0.0), (0.0, 1.0), (-1.0, 0.5), (0.0, 0.0)]
    params = [greedy(presence_penalty=p, frequency_penalty=f) for p, f in cases]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, (p, f), out in zip(PROMPTS, cases, outs, strict=True):
        assert out.token_ids == openai_penalized_greedy(hf, prompt, MAX_TOKENS, eos, p, f), prompt
    plain = llm.generate(PROMPTS[:3], greedy(), use_tqdm=False)
    assert [o.token_ids for o in outs[:3]] != [o.token_ids for o in plain]


def test_min_p_keeps_only_tokens_near_the_most_likely(models) -> None:
    llm, _ = models
    sampled = dict(temperature=1.0, max_tokens=MAX_TOKENS, seed=3, ignore_eos=True)
    plain = llm.generate(PROMPTS, greedy(ignore_eos=True), use_tqdm=False)  # type: ignore[arg-type]
    free = llm.generate(PROMPTS, SamplingParams(**sampled), use_tqdm=False)
    only_top = llm.generate(PROMPTS, SamplingParams(**sampled, min_p=1.0), use_tqdm=False)
    # min_p 1: only the most likely token is left, so sampling is greedy; without it, not.
    assert [o.token_ids for o in only_top] == [o.token_ids for o in plain]
    assert [o.token_ids for o in free] != [o.token_ids for o in plain]


def test_logit_bias_is_transformers_sequence_bias(models) -> None:
    """OpenAI's logit_bias, added to the logits before penalties and sampling: each row of a
    batch its own, against transformers' SequenceBiasLogitsProcessor of one-token sequences."""
    llm, hf = models
    eos = sorted(llm.engine.eos_token_ids)
    plain = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    # ban the first greedy token of row 0; force a token into row 1; nudge row 2; none for row 3
    biases = [{plain[0].token_ids[0]: -100.0}, {77: 100.0}, {5: 4.5, 9: -2.0}, None]
    outs = llm.generate(PROMPTS, [greedy(logit_bias=b) for b in biases], use_tqdm=False)
    for prompt, bias, out in zip(PROMPTS, biases, outs, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, MAX_TOKENS, eos, logit_bias=bias), prompt
    assert outs[0].token_ids[0] != plain[0].token_ids[0]
    assert outs[1].token_ids == [77] * MAX_TOKENS
    assert outs[3].token_ids == plain[3].token_ids
    # with a penalty: the bias first, then the penalty (vLLM's order, and transformers')
    both = greedy(logit_bias={5: 4.5, 9: -2.0}, repetition_penalty=1.5)
    (out,) = llm.generate([PROMPTS[2]], both, use_tqdm=False)
    assert out.token_ids == hf_greedy(
        hf, PROMPTS[2], MAX_TOKENS, eos, repetition_penalty=1.5, logit_bias={5: 4.5, 9: -2.0}
    )
    mine = {3: 1.0}
    params = greedy(logit_bias=mine)
    mine[3] = 100.0  # (the params keep a copy)
    assert params.logit_bias == {3: 1.0}
    for bad in ({3: 100.5}, {-1: 1.0}, {True: 1.0}, [(3, 1.0)]):
        with pytest.raises(ValueError, match="logit_bias"):
            greedy(logit_bias=bad)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([PROMPTS[0]], greedy(logit_bias={10**6: 1.0}), use_tqdm=False)
    assert_no_leak(llm.engine.kv)


def test_allowed_token_ids_is_transformers_prefix_allowed_tokens(models) -> None:
    llm, hf = models
    eos = sorted(llm.engine.eos_token_ids)
    plain = llm.generate(PROMPTS[:3], greedy(), use_tqdm=False)
    # row 0 may not take its greedy first token; row 1 picks among three; row 2 is free
    allowed = [[t for t in range(1, 300) if t != plain[0].token_ids[0]], [7, 70, 300], None]
    params = [greedy(allowed_token_ids=a, logprobs=1) for a in allowed]
    outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    for prompt, a, out in zip(PROMPTS[:3], allowed, outs, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, MAX_TOKENS, eos, allowed_token_ids=a)
    assert set(outs[1].token_ids) <= {7, 70, 300}
    assert outs[2].token_ids == plain[2].token_ids
    # the logprobs stay the model's own: a forced token's rank is its rank in the model
    assert any(e[t].rank > 1 for t, e in zip(outs[1].token_ids, outs[1].outputs[0].logprobs))
    for bad in ([], [-1], "7"):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            greedy(allowed_token_ids=bad)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([PROMPTS[0]], greedy(allowed_token_ids=[10**6]), use_tqdm=False)
    assert_no_leak(llm.engine.kv)
