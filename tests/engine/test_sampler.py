"""Sampler: exact greedy, top-k/top-p masks, seeded determinism independent of the batch."""

from __future__ import annotations

import math

import pytest
import torch

from engine.request import Request
from engine.sampler import Sampler, apply_top_k_top_p
from engine.sampling_params import SamplingParams

NEG_INF = float("-inf")


def req(rid: str, **params: object) -> Request:
    return Request(rid, [1], SamplingParams(**params))  # type: ignore[arg-type]


def test_greedy_is_exact_argmax_with_first_index_on_ties() -> None:
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(0))
    logits[2, 7] = logits[2, 40] = logits[2].max() + 1.0  # a tie: the first index wins, as in HF
    tokens = Sampler().sample(logits, [req(str(i), temperature=0.0) for i in range(5)])
    assert tokens == logits.argmax(-1).tolist() and tokens[2] == 7


def test_top_k_and_top_p_masks_are_exact() -> None:
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3], [0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    masked = apply_top_k_top_p(logits, top_k=torch.tensor([2, 4]), top_p=None)
    assert torch.isinf(masked).tolist() == [[True, False, True, False], [False] * 4]
    # top_p=0.7: 0.5 then 0.3 reach 0.8 >= 0.7, so the tail (0.15, 0.05) goes; 0.5 alone would not do
    masked = apply_top_k_top_p(logits, top_k=None, top_p=torch.tensor([0.7, 0.5]))
    assert torch.isinf(masked).tolist() == [[True, False, True, False], [True, False, True, True]]
    assert torch.equal(masked[0, [1, 3]], logits[0, [1, 3]])  # kept logits are untouched
    assert apply_top_k_top_p(logits, None, None) is logits


def test_a_top_p_of_one_keeps_every_token_beside_a_row_that_cuts() -> None:
    """top_p 1 (the default) is no nucleus, also in a batch with a row of top_p < 1 (a 128k
    vocabulary's float32 cumsum reaches 1.0 early, and half the row's tail was dropped)."""
    logits = torch.randn(2, 131072, generator=torch.Generator().manual_seed(0)) * 4
    out = apply_top_k_top_p(logits.clone(), None, torch.tensor([1.0, 0.5]))
    assert torch.equal(out[0], logits[0])
    assert 0 < int(torch.isinf(out[1]).sum()) < 131072


def test_top_k_keeps_the_tokens_tied_with_the_kth_as_transformers_does() -> None:
    from transformers.generation.logits_process import TopKLogitsWarper

    logits = torch.tensor([[0.0, 2.0, 2.0, 2.0, 1.0], [0.0, 2.0, 1.0, 1.0, 1.0]])
    for k in (1, 2, 3):
        ours = apply_top_k_top_p(logits, top_k=torch.tensor([k, k]), top_p=None)
        hf = TopKLogitsWarper(k)(torch.zeros(2, 1, dtype=torch.long), logits.clone())
        assert torch.equal(torch.isinf(ours), torch.isinf(hf)), k


@pytest.mark.parametrize(
    ("params", "allowed"), [({"top_k": 2}, {1, 3}), ({"top_p": 0.7}, {1, 3}), ({}, {0, 1, 2, 3})]
)
def test_random_sampling_stays_inside_the_kept_set(params: dict, allowed: set[int]) -> None:
    logits = torch.tensor([[0.05, 0.5, 0.15, 0.3]]).log()
    sampler = Sampler(seed=1)
    seen = {sampler.sample(logits, [req("r", temperature=1.0, **params)])[0] for _ in range(300)}
    assert seen == allowed


def test_frequencies_follow_the_softmax_of_logits_over_temperature() -> None:
    logits = torch.tensor([[math.log(0.8), math.log(0.2)]]).repeat(4000, 1)
    tokens = Sampler(seed=3).sample(logits, [req(str(i), temperature=1.0) for i in range(4000)])
    assert abs(tokens.count(0) / 4000 - 0.8) < 0.03
    # temperature 2 flattens 0.8/0.2 to 2/3 vs 1/3
    tokens = Sampler(seed=4).sample(logits, [req(str(i), temperature=2.0) for i in range(4000)])
    assert abs(tokens.count(0) / 4000 - 2 / 3) < 0.03


def test_seeded_request_draws_the_same_tokens_in_any_batch() -> None:
    gen = torch.Generator().manual_seed(5)
    steps = [torch.randn(4, 50, generator=gen) for _ in range(6)]

    alone = req("a", temperature=1.0, seed=123)
    tokens_alone = [Sampler(seed=0).sample(s[:1], [alone])[0] for s in steps]

    batch = [
        req("a", temperature=1.0, seed=123),
        req("b", temperature=0.7),
        req("c", temperature=1.0, seed=9),
        req("d", temperature=0.0),
    ]
    sampler = Sampler(seed=77)  # a different shared seed must not matter for seeded requests
    tokens_batched = [sampler.sample(s, batch)[0] for s in steps]
    assert tokens_batched == tokens_alone

    other_seed = req("a", temperature=1.0, seed=124)
    assert [Sampler().sample(s[:1], [other_seed])[0] for s in steps] != tokens_alone


def test_row_count_must_match() -> None:
    with pytest.raises(ValueError, match="2 logits rows for 1 requests"):
        Sampler().sample(torch.zeros(2, 4), [req("a")])
