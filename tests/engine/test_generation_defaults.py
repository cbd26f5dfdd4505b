"""A checkpoint's generation_config.json as vLLM's --generation-config auto reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.loaders.generation_defaults import (
    GenerationDefaults,
    load_generation_defaults,
    read_generation_defaults,
)


def checkpoint(tmp_path: Path, generation: dict | None) -> Path:
    (tmp_path / "config.json").write_text("{}")
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def test_a_llama_3_instruct_generation_config(tmp_path: Path) -> None:
    path = checkpoint(
        tmp_path,
        {
            "bos_token_id": 128000,
            "do_sample": True,
            "eos_token_id": [128001, 128009],
            "temperature": 0.6,
            "top_p": 0.9,
            "transformers_version": "4.42.3",
        },
    )
    assert read_generation_defaults(path) == GenerationDefaults(temperature=0.6, top_p=0.9)
    assert load_generation_defaults(str(path), "auto").describe() == "temperature=0.6, top_p=0.9"


def test_every_value_the_file_sets_counts(tmp_path: Path) -> None:
    """As vLLM with transformers 5 (whose GenerationConfig defaults are all unset, so
    to_diff_dict keeps every key the file sets): a top_k of 50 is a default of 50; vLLM reads
    top_k 0 as off; min_p and the penalties count as the rest (vLLM applies them too)."""
    path = checkpoint(
        tmp_path,
        {
            "temperature": 1.0,
            "top_p": 0.95,
            "top_k": 50,
            "repetition_penalty": 1.0,
            "max_new_tokens": 256,
        },
    )
    assert read_generation_defaults(path) == GenerationDefaults(
        temperature=1.0, top_p=0.95, top_k=50, max_tokens=256, repetition_penalty=1.0
    )
    path = checkpoint(
        tmp_path, {"top_k": 0, "repetition_penalty": 1.1, "min_p": 0.05, "presence_penalty": 0.5}
    )
    defaults = read_generation_defaults(path).as_sampling_params()
    assert defaults.top_k == -1
    assert (defaults.repetition_penalty, defaults.min_p) == (1.1, 0.05)
    assert (defaults.presence_penalty, defaults.frequency_penalty) == (0.5, 0.0)


def test_a_value_no_request_may_have_is_refused_with_the_file(tmp_path: Path) -> None:
    """Else every request that leaves the field out would be refused, blaming the client."""
    path = checkpoint(tmp_path, {"temperature": -1.0})
    with pytest.raises(ValueError, match="generation_config.json: .*temperature"):
        read_generation_defaults(path)


def test_sources_without_a_generation_config(tmp_path: Path) -> None:
    assert load_generation_defaults("default", "auto") == GenerationDefaults()  # the GGUF
    assert load_generation_defaults("llama-3-8b", "dummy") == GenerationDefaults()
    assert read_generation_defaults(checkpoint(tmp_path, None)) == GenerationDefaults()
    (tmp_path / "generation_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="a JSON object"):
        read_generation_defaults(tmp_path)


def test_the_offline_llm_samples_with_the_checkpoints_defaults(
    tiny_hf_checkpoints: dict[str, Path],
) -> None:
    """LLM(generation_config="auto"), vLLM's default: generate without params samples as the
    checkpoint says; "none" keeps SamplingParams' defaults."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    directory = tiny_hf_checkpoints["qwen2"]
    saved = (directory / "generation_config.json").read_text()
    generation = json.loads(saved) | {"temperature": 0.0, "max_new_tokens": 3}
    (directory / "generation_config.json").write_text(json.dumps(generation))
    try:
        llm = LLM(str(directory), page_size=4, num_pages=65)
        default = llm.get_default_sampling_params()
        assert (default.temperature, default.max_tokens) == (0.0, 3)
        [out] = llm.generate([[0, 7, 8, 9]])
        assert len(out.token_ids) <= 3
        greedy = llm.generate([[0, 7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=3))
        assert out.token_ids == greedy[0].token_ids
        plain = LLM(str(directory), generation_config="none", page_size=4, num_pages=65)
        assert plain.get_default_sampling_params() == SamplingParams()
    finally:
        (directory / "generation_config.json").write_text(saved)
