"""load_model refuses bad input with errors that name the argument and what is allowed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.loaders import load_model


def test_unknown_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.gguf"
    with pytest.raises(
        FileNotFoundError, match="nowhere.gguf.*does not exist; expected 'default', a .gguf file"
    ):
        load_model(str(missing))


def test_unknown_format(tiny_llama3_dir: Path) -> None:
    with pytest.raises(
        ValueError,
        match=r"load_format 'safetensors' is not supported; expected one of \('auto', 'gguf', 'hf', 'dummy'\)",
    ):
        load_model(str(tiny_llama3_dir), load_format="safetensors")  # type: ignore[arg-type]


def test_format_mismatch(tiny_llama3_dir: Path, gguf_path: Path) -> None:
    with pytest.raises(ValueError, match="is a hf checkpoint, but load_format='gguf'"):
        load_model(str(tiny_llama3_dir), load_format="gguf")
    with pytest.raises(ValueError, match="is a gguf checkpoint, but load_format='hf'"):
        load_model(str(gguf_path), load_format="hf")


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError,
        match="cannot tell the format .* expected a .gguf file or a directory with config.json",
    ):
        load_model(str(tmp_path))


def test_unsupported_model_type(tiny_llama3_dir: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(tiny_llama3_dir, tmp_path / "gpt2ish"))
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        load_model(str(copy))


def test_missing_weights(tiny_llama3_dir: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(tiny_llama3_dir, tmp_path / "noweights"))
    for weights in copy.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(FileNotFoundError, match=r"has no \*.safetensors weights"):
        load_model(str(copy))


def test_dummy_arguments() -> None:
    with pytest.raises(ValueError, match="dummy_config is only used with load_format='dummy'"):
        load_model("default", dummy_config={"model_type": "llama"})
    with pytest.raises(
        FileNotFoundError,
        match=r"'llama-9b' is neither a preset \['llama-3-8b', 'llama-3.1-8b', 'qwen3-8b'\]",
    ):
        load_model("llama-9b", load_format="dummy")
    with pytest.raises(TypeError, match="dummy_config must be a ModelConfig or a dict"):
        load_model("x", load_format="dummy", dummy_config=[1, 2])  # type: ignore[arg-type]
