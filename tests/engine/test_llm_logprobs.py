"""SamplingParams.logprobs (engine/logprobs.py): each generated token's log probability, rank and
the most likely tokens of its position, in the model's raw distribution, against transformers'
raw logits of the same greedy continuation (``output_logits``), on the tiny random Llama 3."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams

from .conftest_engine import assert_no_leak

MAX_TOKENS = 8
PROMPTS = [[0, 17, 42, 99, 3], [0, 250, 8], [0, *range(30, 50)]]


@pytest.fixture(scope="module")
def models(tiny_hf_checkpoints: dict[str, Path]) -> tuple[LLM, object]:
    from transformers import AutoModelForCausalLM

    directory = tiny_hf_checkpoints["llama3"]
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return LLM(str(directory), page_size=4, num_pages=128), hf


def hf_logprobs(hf: object, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' log-softmax of the raw logits at each of ``tokens``' positions [T, V]."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + tokens])).logits[0].float()  # type: ignore[operator]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].log_softmax(dim=-1)


def test_logprobs_are_the_models_raw_distribution(models) -> None:
    llm, hf = models
    # Rows asking for 3, 0 and none in one batch; the penalty (1.5) moves the tokens, not the
    # logprobs, which are of the raw logits (vLLM's default).
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3, ignore_eos=True),
        SamplingParams(
            temperature=0,
            max_tokens=MAX_TOKENS,
            logprobs=0,
            repetition_penalty=1.5,
            ignore_eos=True,
        ),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
    ]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert outs[2].logprobs is None and outs[2].outputs[0].logprobs is None
    for prompt, p, out in zip(PROMPTS[:2], params[:2], outs[:2], strict=True):
        want = hf_logprobs(hf, prompt, out.token_ids)
        completion = out.outputs[0]
        assert len(completion.logprobs) == len(out.token_ids) == MAX_TOKENS
        for pos, (token, entry) in enumerate(zip(out.token_ids, completion.logprobs, strict=True)):
            row = want[pos]
            assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top_values, top_ids = row.topk(p.logprobs)
            # the k most likely (ranks 1..k), and the sampled token with its own rank
            assert {t for t, e in entry.items() if e.rank <= p.logprobs} == set(top_ids.tolist())
            assert set(entry) == set(top_ids.tolist()) | {token}
            for t, value in zip(top_ids.tolist(), top_values.tolist(), strict=True):
                assert entry[t].logprob == pytest.approx(value, abs=1e-4)
            assert entry[token].decoded_token == llm.tokenizer.decode([token])
        assert completion.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(out.token_ids, completion.logprobs, strict=True))
        )
    assert all(e[t].rank == 1 for t, e in zip(outs[0].token_ids, outs[0].outputs[0].logprobs))
    assert any(e[t].rank > 1 for t, e in zip(outs[1].token_ids, outs[1].outputs[0].logprobs))
    assert_no_leak(llm.engine.kv)


def test_sampled_tokens_get_their_own_logprob_and_rank(models) -> None:
    llm, hf = models
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=MAX_TOKENS, logprobs=1, n=2)
    (out,) = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    for completion in out.outputs:
        want = hf_logprobs(hf, PROMPTS[0], completion.token_ids)
        for pos, token in enumerate(completion.token_ids):
            entry = completion.logprobs[pos][token]
            assert entry.logprob == pytest.approx(want[pos, token].item(), abs=1e-4)
            assert entry.rank == int((want[pos] > want[pos, token]).sum()) + 1
            assert math.isfinite(entry.logprob) and entry.logprob <= 0
    with pytest.raises(ValueError, match="logprobs must be None or an integer in \\[0, 20\\]"):
        SamplingParams(logprobs=21)


def test_a_first_token_sampled_elsewhere_needs_its_logprobs(models) -> None:
    """A decode worker's request that asks for logprobs gets the first token's with it; without
    them it is refused before the scheduler takes it (nothing held, nothing left running)."""
    llm, _ = models
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=1)
    with pytest.raises(ValueError, match="came without them"):
        engine.add_recomputed_request("r", [0, 5, 6], 7, params, first_text_sent=0)
    assert not engine.has_unfinished()
    assert_no_leak(engine.kv)
    # vLLM's shape: the sampled token first, then the top ones
    (out,) = llm.generate([[0, 5, 6]], params, use_tqdm=False)
    assert all(next(iter(e)) == t for t, e in zip(out.token_ids, out.outputs[0].logprobs))
