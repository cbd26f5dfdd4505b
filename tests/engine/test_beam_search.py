"""Beam search as vLLM's LLM.beam_search: the search over a scripted step (exact beams, ranks,
EOS, length penalty, limits), and LLM.beam_search on the embedded SmolLM2 against greedy
generate and transformers' own beam search."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.beam_search import BeamSearchParams, BeamSearchSequence, beam_score, beam_search
from engine.llm import LLM
from engine.logprobs import Logprob
from engine.sampling_params import SamplingParams

from .conftest_engine import SHARED_PREFIX, assert_no_leak

EOS = 9
# Candidates (token -> logprob) after each last token; 2 * beam_width = 4 of them, as each step
# asks the engine for.
NEXT = {
    0: {1: -0.1, 2: -0.5, EOS: -2.0, 3: -3.0},
    1: {EOS: -0.1, 4: -1.0, 5: -1.5, 6: -4.0},
    2: {7: -0.2, EOS: -0.3, 8: -2.5, 6: -3.0},
}
OTHER = {EOS: -0.05, 1: -1.0, 2: -2.0, 3: -3.0}


class ScriptedStep:
    """A model that answers by the last token alone; records each step's beams."""

    def __init__(self) -> None:
        self.calls: list[list[list[int]]] = []

    def __call__(self, beams: list[list[int]]) -> list[dict[int, Logprob]]:
        self.calls.append([list(b) for b in beams])
        return [
            {t: Logprob(v, r + 1) for r, (t, v) in enumerate(NEXT.get(b[-1], OTHER).items())}
            for b in beams
        ]


def search(prompts: list[list[int]], max_model_len: int = 100, **params: Any) -> Any:
    step = ScriptedStep()
    limit = params.pop("concurrency_limit", None)
    out = beam_search(
        prompts,
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 2, **params}),
        step,
        eos_token_id=EOS,
        max_model_len=max_model_len,
        decode=lambda ids: " ".join(map(str, ids)),
        concurrency_limit=limit,
    )
    return out, step


def summary(seqs: list[BeamSearchSequence]) -> list[tuple[list[int], float, str | None]]:
    return [(s.tokens, round(s.cum_logprob, 6), s.finish_reason) for s in seqs]


def test_beams_rank_finish_at_eos_and_drop_its_text() -> None:
    (out,), step = search([[0]])
    # step 1 keeps [0 1] and [0 2] ([0 9] is finished); step 2 keeps [0 2 7] and [0 1 4]; then
    # all five rank by cum / len (prompt included, a final EOS not): -0.1, -0.233, -0.367, ...
    assert step.calls == [[[0]], [[0, 1], [0, 2]]]
    assert summary(out.sequences) == [([0, 1, EOS], -0.2, "stop"), ([0, 2, 7], -0.7, "length")]
    assert [s.text for s in out.sequences] == ["0 1", "0 2 7"]
    assert [len(s.logprobs) for s in out.sequences] == [2, 2]
    assert out.sequences[0].logprobs[1] == {
        t: Logprob(v, r + 1) for r, (t, v) in enumerate(NEXT[1].items())
    }
    (kept,), _ = search([[0]], include_stop_str_in_output=True)
    assert kept.sequences[0].text == "0 1 9"


def test_length_penalty_ranks_as_vllm() -> None:
    (out,), _ = search([[0]], length_penalty=-1.0)  # score = cum * len: short ones win
    assert summary(out.sequences) == [([0, 1, EOS], -0.2, "stop"), ([0, 2, EOS], -0.8, "stop")]
    assert beam_score([0, 1, EOS], -0.2, EOS, 1.0) == pytest.approx(-0.1)
    assert beam_score([0, 1, 4], -1.1, EOS, 2.0) == pytest.approx(-1.1 / 9)


def test_ignore_eos_keeps_eos_beams_alive() -> None:
    (out,), step = search([[0]], ignore_eos=True, beam_width=1, max_tokens=3)
    assert step.calls == [[[0]], [[0, 1]], [[0, 1, EOS]]]
    assert summary(out.sequences) == [([0, 1, EOS, EOS], -0.25, "length")]


def test_max_model_len_and_concurrency_limit() -> None:
    (short, other), step = search([[0], [2]], max_model_len=3, max_tokens=5, concurrency_limit=1)
    # one prompt at a time; a beam of max_model_len tokens ends there
    assert [len(c) for c in step.calls] == [1, 2, 1, 2]
    assert step.calls[0] == [[0]] and step.calls[2] == [[2]]
    assert all(len(s.tokens) <= 3 for s in short.sequences + other.sequences)
    assert {s.finish_reason for s in short.sequences} == {"stop", "length"}


def test_params_are_checked_when_made() -> None:
    for fields, message in (
        ({"beam_width": 0}, "beam_width must be an integer in \\[1, 10\\]"),
        ({"beam_width": 11}, "beam_width must be an integer in \\[1, 10\\]"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"temperature": 3.0}, "temperature must be in \\[0, 2\\]"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool"),
    ):
        with pytest.raises(ValueError, match=message):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **fields})


# ---- LLM.beam_search on the embedded SmolLM2 ----
N = 8
PROMPT = "def fibonacci(n):"


def greedy(llm: LLM, ids: list[int]) -> Any:
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, logprobs=0)
    return llm.generate(ids, params, use_tqdm=False)[0].outputs[0]


@pytest.mark.slow
def test_one_beam_is_greedy(smollm_llm: LLM) -> None:
    ids = smollm_llm.tokenizer.encode(PROMPT)
    (out,) = smollm_llm.beam_search(
        [{"prompt": PROMPT}], BeamSearchParams(beam_width=1, max_tokens=N, ignore_eos=True)
    )
    (seq,) = out.sequences
    want = greedy(smollm_llm, ids)
    assert seq.tokens == ids + want.token_ids
    assert seq.cum_logprob == pytest.approx(want.cumulative_logprob, abs=1e-4)
    assert seq.text == smollm_llm.tokenizer.decode(seq.tokens)  # (prompt included, as vLLM's)
    assert_no_leak(smollm_llm.engine.kv)


@pytest.mark.slow
def test_beams_match_transformers_beam_search(smollm_llm: LLM, hf_gguf_model: Any) -> None:
    """With EOS out of play the two searches mean the same (the k best of the beams' 2k best
    candidates each; every beam of one length, so the length penalty cannot reorder them):
    transformers' num_beams=3 gives the same sequences in the same order, and the same scores
    (transformers divides by the generated length alone)."""
    ids = smollm_llm.tokenizer.encode(PROMPT)
    (out,) = smollm_llm.beam_search(
        [ids], BeamSearchParams(beam_width=3, max_tokens=N, ignore_eos=True)
    )
    seqs = out.sequences
    scores = [beam_score(s.tokens, s.cum_logprob, EOS, 1.0) for s in seqs]
    assert scores == sorted(scores, reverse=True) and len(seqs) == 3
    assert seqs[0].cum_logprob >= greedy(smollm_llm, ids).cumulative_logprob
    config = hf_gguf_model.generation_config
    saved, config.eos_token_id = config.eos_token_id, None
    try:
        with torch.inference_mode():
            hf = hf_gguf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                num_beams=3,
                num_return_sequences=3,
                max_new_tokens=N,
                length_penalty=1.0,
                early_stopping=True,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
    finally:
        config.eos_token_id = saved
    assert [s.tokens for s in seqs] == hf.sequences.tolist()
    assert [s.cum_logprob for s in seqs] == pytest.approx(
        (hf.sequences_scores * N).tolist(), abs=1e-3
    )
    assert_no_leak(smollm_llm.engine.kv)


@pytest.mark.slow
def test_beams_finish_at_eos_and_share_the_prefix_cache(smollm_llm: LLM) -> None:
    eos = smollm_llm.tokenizer.eos_token_id
    before = smollm_llm.engine.kv.stats().reuse_hit_tokens
    (out,) = smollm_llm.beam_search(SHARED_PREFIX, BeamSearchParams(beam_width=2, max_tokens=4))
    assert len(out.sequences) == 2
    for seq in out.sequences:
        assert (seq.finish_reason == "stop") == (seq.tokens[-1] == eos)
        assert seq.text == smollm_llm.tokenizer.decode(
            seq.tokens[:-1] if seq.finish_reason == "stop" else seq.tokens
        )
    # the later steps' beams read their shared prompt's whole pages from the cache
    prompt_pages = len(smollm_llm.tokenizer.encode(SHARED_PREFIX)) // 16
    assert prompt_pages >= 1
    assert smollm_llm.engine.kv.stats().reuse_hit_tokens - before >= 2 * prompt_pages * 16
    assert_no_leak(smollm_llm.engine.kv)


def test_beam_search_refuses_what_it_cannot_do(smollm_llm: LLM) -> None:
    params = BeamSearchParams(beam_width=2, max_tokens=2)
    with pytest.raises(ValueError, match="params must be a BeamSearchParams"):
        smollm_llm.beam_search(["a"], SamplingParams())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="concurrency_limit must be None or an integer >= 1"):
        smollm_llm.beam_search(["a"], params, concurrency_limit=0)
    with pytest.raises(ValueError, match="lora_request: Duet serves no LoRA adapters"):
        smollm_llm.beam_search(["a"], params, lora_request=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_model_len"):
        smollm_llm.beam_search([[1] * 2048], params)
