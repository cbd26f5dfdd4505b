"""The dtype a checkpoint holds its weights in: what ``dtype="auto"`` loads.

The rule is transformers' ``torch_dtype="auto"``, the engine's oracle: an HF checkpoint's
config.json names it (``dtype``, or ``torch_dtype`` before transformers 4.56), else its first
floating-point safetensors tensor says it; a GGUF file loads in float32 (transformers dequantizes
GGUF weights to float32), and so do dummy weights without a checkpoint. vLLM's "auto" differs in
one case: it casts a float32 checkpoint to bfloat16 (or float16); Duet keeps float32, the dtype
its token-for-token checks against transformers are made in.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from engine.engine_config import DTYPES, dtype_name
from engine.loaders.source import checkpoint_path, detect_format

_SAFETENSORS_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_HEADER_LIMIT = 100 << 20  # safetensors' own cap on a header's size


def checkpoint_dtype(source: str, load_format: str = "auto", dummy_config: Any = None) -> str:
    """ "float32", "bfloat16" or "float16": the dtype ``source`` stores its weights in (module
    docstring). With ``load_format="dummy"``, a ``dummy_config`` dict's own ``dtype`` or
    ``torch_dtype`` when it names one, else the checkpoint at ``source`` when there is one (dummy
    weights of a checkpoint's shape), else float32."""
    if load_format == "dummy":
        if isinstance(dummy_config, dict):
            named = _named(dummy_config)
            if named is not None:
                return named
        path = Path(source).expanduser()
        if dummy_config is None and path.is_dir() and (path / "config.json").is_file():
            return _hf_dtype(path)
        return "float32"
    path = checkpoint_path(source)
    if detect_format(path) == "gguf":
        return "float32"
    return _hf_dtype(path)


def _hf_dtype(path: Path) -> str:
    named = _named(json.loads((path / "config.json").read_text()))
    if named is not None:
        return named
    for file in sorted(path.glob("*.safetensors")):
        for entry in _safetensors_header(file).values():
            if isinstance(entry, dict) and entry.get("dtype") in _SAFETENSORS_NAMES:
                return _SAFETENSORS_NAMES[entry["dtype"]]
    return "float32"


def _named(config: dict[str, Any]) -> str | None:
    """config.json's dtype (multimodal checkpoints put it in ``text_config``), if it names one."""
    for holder in (config, config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            value = holder.get(key)
            name = dtype_name(value.removeprefix("torch.")) if isinstance(value, str) else None
            if name in DTYPES:
                return name
    return None


def _safetensors_header(file: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (an 8-byte little-endian length, then the JSON)."""
    with file.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > _HEADER_LIMIT:
            return {}
        return json.loads(f.read(length))
