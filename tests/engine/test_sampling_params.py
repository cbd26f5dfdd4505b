"""SamplingParams: defaults, normalization, and a clear error for every invalid field."""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams, SamplingParamsError


def test_defaults_follow_vllm() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed) == (1.0, 1.0, -1, 16, None)
    assert p.stop == () and p.stop_token_ids == ()
    assert not p.ignore_eos and not p.include_stop_str_in_output and p.skip_special_tokens
    assert not p.is_greedy and SamplingParams(temperature=0).is_greedy


def test_stop_is_normalized_to_a_tuple() -> None:
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=None).stop == ()  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(stop=["a", "xyz"]).max_stop_len == 3
    assert SamplingParams().max_stop_len == 0


def test_changes_are_validated_as_construction_is() -> None:
    params = SamplingParams()
    params.temperature = 0.5
    params.stop_token_ids = [3, 4]
    assert (params.temperature, params.stop_token_ids) == (0.5, (3, 4))
    with pytest.raises(SamplingParamsError, match="top_p must be in"):
        params.top_p = 0.0
    assert params.top_p == 1.0  # (a refused change leaves the object as it was)
    # Rules between fields hold once it is used, not after each assignment (order is free)
    params.min_tokens = 100
    params.max_tokens = 200
    params.max_tokens = 50
    with pytest.raises(SamplingParamsError, match="min_tokens must be at most max_tokens=50"):
        params.copy()  # (what a request of it makes: engine/engine_core.make_request)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"temperature": -0.1},
            "SamplingParams.temperature must be in [0, 2], got -0.1",
        ),
        ({"temperature": float("nan")}, "SamplingParams.temperature must be in [0, 2]"),
        ({"top_p": 0.0}, "SamplingParams.top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "SamplingParams.top_p must be in (0, 1], got 1.5"),
        (
            {"top_k": -2},
            "SamplingParams.top_k must be -1 or 0 (disabled) or an integer >= 1, got -2",
        ),
        (
            {"top_k": 2.0},
            "SamplingParams.top_k must be -1 or 0 (disabled) or an integer >= 1, got 2.0",
        ),
        ({"max_tokens": 0}, "SamplingParams.max_tokens must be an integer >= 1 or None, got 0"),
        (
            {"max_tokens": True},
            "SamplingParams.max_tokens must be an integer >= 1 or None, got True",
        ),
        (
            {"seed": "7"},
            "SamplingParams.seed must be an integer in [-2**63, 2**64) or None, got '7'",
        ),
        # (torch.Generator takes no more: it failed the engine step, every request with it)
        ({"seed": 2**64}, "SamplingParams.seed must be an integer in [-2**63, 2**64) or None"),
        ({"seed": -(2**63) - 1}, "SamplingParams.seed must be an integer in [-2**63, 2**64)"),
        ({"stop": [""]}, "SamplingParams.stop must be non-empty strings, got ''"),
        ({"stop": [3]}, "SamplingParams.stop must be non-empty strings, got 3"),
        ({"stop": 3}, "SamplingParams.stop must be a string or a list of strings, got 3"),
        ({"stop_token_ids": [-1]}, "SamplingParams.stop_token_ids must be integers >= 0, got -1"),
        (
            {"stop_token_ids": "ab"},
            "SamplingParams.stop_token_ids must be a list of token ids, got 'ab'",
        ),
        ({"ignore_eos": 1}, "SamplingParams.ignore_eos must be a bool, got 1"),
    ],
)
def test_invalid_fields_raise_naming_field_and_range(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert str(err.value).startswith(message)


def test_boundaries_are_accepted() -> None:
    p = SamplingParams(temperature=0, top_p=1.0, top_k=1, max_tokens=1, seed=0)
    assert p.top_k == 1 and p.max_tokens == 1 and p.seed == 0
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1 and SamplingParams(seed=-(2**63)).seed
    assert SamplingParams(top_p=1e-6).top_p == 1e-6


def test_each_choice_of_a_seeded_request_is_seeded_also_past_minus_one() -> None:
    """Choice i takes seed + i; -1 among them is that seed, not "no seed" (a user's -1 is): the
    choice came out different at every call."""
    params = SamplingParams(n=3, seed=-2, temperature=1.0)
    assert [params.for_choice(i).seed for i in range(3)] == [-2, -1, 0]
    assert SamplingParams(n=2, seed=-1).for_choice(1).seed is None  # (no seed at all)


def test_vllm_s_off_values() -> None:
    """As vLLM: top_k 0 keeps all tokens (stored as -1), max_tokens None runs to the model's
    max length."""
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(max_tokens=None).max_tokens is None
