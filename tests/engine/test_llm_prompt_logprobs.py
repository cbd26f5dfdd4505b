"""SamplingParams.prompt_logprobs (engine/prompt_logprobs.py): each prompt token's log probability,
rank and the most likely tokens of its position given the tokens before it, against transformers'
log-softmax of the prompt's own logits, on the tiny random Llama 3: in one chunk and in several, next
to requests that ask nothing, and for a prompt the prefix cache already holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams

from .conftest_engine import assert_no_leak

PROMPTS = [[0, *range(30, 51)], [0, 250, 8], [0, 17, 42, 99, 3]]


@pytest.fixture(scope="module")
def hf(tiny_hf_checkpoints: dict[str, Path]) -> object:
    from transformers import AutoModelForCausalLM

    directory = tiny_hf_checkpoints["llama3"]
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_hf_checkpoints: dict[str, Path]) -> LLM:
    # Chunks of 8 tokens: the 22-token prompt is scored in three steps, each chunk's last row
    # scoring the next chunk's first token.
    return LLM(
        str(tiny_hf_checkpoints["llama3"]),
        page_size=4,
        num_pages=128,
        prefill_chunk_size=8,
        max_num_batched_tokens=16,
        max_num_seqs=8,
    )


def prompt_logprobs(hf: object, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax of the prompt's logits: row j scores prompt token j + 1."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt])).logits[0].float()  # type: ignore[operator]
    return logits[:-1].log_softmax(dim=-1)


def assert_models(hf: object, prompt: list[int], got: list, k: int) -> None:
    want = prompt_logprobs(hf, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for pos, (token, entry) in enumerate(zip(prompt[1:], got[1:], strict=True)):
        row = want[pos]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top_values, top_ids = row.topk(k)
        assert set(entry) == set(top_ids.tolist()) | {token}
        for t, value in zip(top_ids.tolist(), top_values.tolist(), strict=True):
            assert entry[t].logprob == pytest.approx(value, abs=1e-4)


def test_prompt_logprobs_are_the_models_in_one_chunk_or_several(llm: LLM, hf: object) -> None:
    params = [
        SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2),  # three chunks
        SamplingParams(temperature=0, max_tokens=3),  # asks nothing, shares the steps
        SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0, logprobs=1),
    ]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert_models(hf, PROMPTS[0], outs[0].prompt_logprobs, 2)
    assert_models(hf, PROMPTS[2], outs[2].prompt_logprobs, 0)
    assert outs[1].prompt_logprobs is None and outs[1].prompt_token_logprobs is None
    named = outs[0].prompt_logprobs[1][PROMPTS[0][1]]
    assert named.decoded_token == llm.tokenizer.token_text(PROMPTS[0][1])
    # the generated tokens are those of a request that asks nothing
    plain = llm.generate([PROMPTS[0], PROMPTS[2]], SamplingParams(temperature=0, max_tokens=3))
    assert [o.token_ids for o in plain] == [outs[0].token_ids, outs[2].token_ids]
    assert_no_leak(llm.engine.kv)


def test_a_cached_prompt_is_computed_again_for_its_logprobs(llm: LLM, hf: object) -> None:
    prompt = [0, *range(60, 80)]
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)  # now cached
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert out.metrics.num_cached_tokens == 0
    assert_models(hf, prompt, out.prompt_logprobs, 1)
    # its pages stay findable for requests that do not score the prompt
    (again,) = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    assert again.metrics.num_cached_tokens == 20
    assert_no_leak(llm.engine.kv)


def test_n_completions_share_the_first_ones_prompt_logprobs(llm: LLM, hf: object) -> None:
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=2, n=3, prompt_logprobs=1)
    (out,) = llm.generate([PROMPTS[2]], params, use_tqdm=False)
    assert len(out.outputs) == 3
    assert_models(hf, PROMPTS[2], out.prompt_logprobs, 1)


def test_a_request_preempted_while_scoring_its_prompt_keeps_its_entries(
    tiny_hf_checkpoints: dict[str, Path], hf: object
) -> None:
    """Nine pages for two 22-token prompts: the second is preempted after two of its three chunks
    were scored, recomputed from its first token, and scores only the rest."""
    llm = LLM(
        str(tiny_hf_checkpoints["llama3"]),
        page_size=4,
        num_pages=9,
        prefill_chunk_size=8,
        max_num_batched_tokens=16,
        max_num_seqs=8,
        max_model_len=32,
    )
    prompts = [PROMPTS[0], [0, *range(100, 121)]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[1].metrics.num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert_models(hf, prompt, out.prompt_logprobs, 1)
    assert_no_leak(llm.engine.kv)


def test_a_one_token_prompt_has_only_none() -> None:
    params = SamplingParams(prompt_logprobs=3)
    from engine.request import Request

    request = Request("r", [5], params)
    assert request.prompt_logprobs == (None,) and not request.wants_prompt_logits


@pytest.mark.parametrize("value", [-1, 21, True, 1.5])
def test_prompt_logprobs_outside_zero_to_twenty_are_refused(value: object) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs must be None or an integer"):
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]
