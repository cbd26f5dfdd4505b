"""Acceptance: bad input to LLM raises a ValueError naming the field, and leaves nothing allocated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.llm import LLM
from engine.loaders import LoadedModel
from engine.sampling_params import SamplingParams

from .conftest_engine import assert_no_leak

OK = SamplingParams(temperature=0.0, max_tokens=2)


@pytest.fixture
def tiny_llm(tiny_llama3_loaded: LoadedModel) -> LLM:
    return LLM.from_loaded(tiny_llama3_loaded, page_size=4, num_pages=32, max_model_len=32)


def assert_untouched(llm: LLM) -> None:
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv.num_free_pages("full") == 31
    assert_no_leak(llm.engine.kv)


@pytest.mark.parametrize(
    ("prompts", "params", "message"),
    [
        ("", OK, "prompts[0]: the prompt is empty"),
        (3, OK, "prompts must be a string, a list of token ids, a prompt dict, or a list of"),
        (["hello", ""], OK, "prompts[1]: the prompt is empty"),
        ([[5, 6], []], OK, "prompts[1]: the prompt is empty (need at least one token)"),
        ([[3] * 32], OK, "prompts[0]: the prompt has 32 tokens; with at least one output token"),
        (["hello " * 40], OK, "prompts[0]: the prompt has"),
        ([[5, 99999]], OK, "prompts[0]: token id 99999 is not an integer in [0, vocab_size=320)"),
        ([[5, -1]], OK, "prompts[0]: token id -1 is not an integer in [0, vocab_size=320)"),
        ([3.5], OK, "prompts[0]: expected a string, a list of token ids or a prompt dict, got"),
        ({"prompt": "a", "x": 1}, OK, "prompts[0]: a prompt dict has one of 'prompt' or"),
        ([{"prompt_token_ids": [5], "multi_modal_data": {}}], OK, "prompts[0]: a prompt dict"),
        # (text under prompt_token_ids was tokenized again, special tokens and all)
        ({"prompt_token_ids": "hello"}, OK, "prompts[0]: 'prompt_token_ids' must be a list"),
        ({"prompt": [5, 6]}, OK, "prompts[0]: 'prompt' must be a string"),
        (
            ["a"],
            {"temperature": 0},
            "sampling_params must be a SamplingParams or a list of them, got dict",
        ),
        (["a", "b"], [OK], "sampling_params has 1 entries for 2 prompts; give one per prompt"),
        (["a", "b"], [OK, None], "sampling_params[1] must be a SamplingParams, got NoneType"),
    ],
)
def test_bad_generate_input(tiny_llm: LLM, prompts: Any, params: Any, message: str) -> None:
    with pytest.raises(ValueError) as err:
        tiny_llm.generate(prompts, params)
    assert str(err.value).startswith(message)
    assert_untouched(tiny_llm)
    assert [o.finish_reason for o in tiny_llm.generate(["hello", [5, 6]], OK)] == [
        "length",
        "length",
    ]
    assert_untouched(tiny_llm)


def test_bad_chat_input(tiny_llm: LLM) -> None:
    with pytest.raises(ValueError, match="messages must be a non-empty list"):
        tiny_llm.chat([])
    with pytest.raises(
        ValueError, match=r"messages\[1\] must be a non-empty list of message dicts"
    ):
        tiny_llm.chat([[{"role": "user", "content": "hi"}], []])
    with pytest.raises(
        ValueError, match=r"messages\[0\]: the prompt has \d+ tokens; with at least one output"
    ):
        tiny_llm.chat([{"role": "user", "content": "hello world " * 20}])
    assert_untouched(tiny_llm)


def test_invalid_sampling_params_fail_before_reaching_the_engine() -> None:
    with pytest.raises(ValueError, match=r"SamplingParams.top_p must be in \(0, 1\], got 2"):
        SamplingParams(top_p=2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"model": "/nonexistent/model.gguf"},
            "LLM.model='/nonexistent/model.gguf' (load_format='auto'): model source",
        ),
        (
            {"load_format": "onnx"},
            "LLM.load_format must be one of ('auto', 'gguf', 'hf', 'dummy'), got 'onnx'",
        ),
        (
            {"dtype": "int8"},
            "LLM.dtype must be 'auto' or one of ('float32', 'bfloat16', 'float16', 'half', 'float'), got 'int8'",
        ),
        ({"num_pages": 1}, "LLM.num_pages must be an integer >= 2, got 1"),
        ({"page_size": 0}, "LLM.page_size must be an integer >= 1, got 0"),
        (
            {"reuse_policy": "always"},
            "LLM.reuse_policy must be one of ['none', 'all_reusable', 'per_request']",
        ),
        ({"max_stats_len": -2}, "LLM.max_stats_len must be an integer >= -1, got -2"),
        ({"bogus": 1}, "unknown LLM arguments ['bogus']"),
    ],
)
def test_bad_llm_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as err:
        LLM(**kwargs)
    assert str(err.value).startswith(message)


def test_directory_that_is_no_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot tell the format of model source"):
        LLM(str(tmp_path))


def test_max_model_len_beyond_the_model(tiny_llama3_loaded: LoadedModel) -> None:
    with pytest.raises(
        ValueError, match="LLM.max_model_len=1000 exceeds the model's max_position_embeddings=256"
    ):
        LLM.from_loaded(tiny_llama3_loaded, num_pages=8, max_model_len=1000)


def test_a_pool_too_small_for_one_longest_request_refuses_to_start(
    tiny_llama3_loaded: LoadedModel,
) -> None:
    """(A request that can never fit a pool the scheduler was given ends with an error output:
    tests/engine/test_scheduler_preemption.py.)"""
    with pytest.raises(
        ValueError,
        match="one request of max_model_len=64 tokens cannot fit: group 'full' has 2 usable "
        "pages, one request needs 16",
    ):
        LLM.from_loaded(tiny_llama3_loaded, page_size=4, num_pages=3, max_model_len=64)
