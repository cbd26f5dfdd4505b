"""The sampling defaults a checkpoint asks for in its generation_config.json, read as vLLM reads
them (``--generation-config auto``): every key the file sets counts (with transformers 5, whose
``GenerationConfig`` defaults are all unset, vLLM's ``to_diff_dict`` keeps each of them; a file's
top_k 50 is a top_k of 50). A request's own value always wins; these fill only what it leaves out.

What Duet samples with: temperature, top_p, top_k, min_p, the three penalties, and
``max_new_tokens`` as the default max_tokens of a chat request (vLLM's list).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from engine.loaders.source import checkpoint_path, detect_format
from engine.sampling_params import SamplingParams

# SamplingParams fields the file may set (max_tokens from its max_new_tokens)
_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


@dataclass(frozen=True)
class GenerationDefaults:
    """What a request leaves out is sampled with these (None: Duet's own default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def as_sampling_params(self) -> SamplingParams:
        """SamplingParams' defaults with these in their place (ValueError for a value no request
        may have)."""
        given = {k: v for k, v in self.fields().items() if v is not None}
        return SamplingParams(**given)

    def fields(self) -> dict[str, float | int | None]:
        """Each SamplingParams field this sets or leaves out (None)."""
        return {k: getattr(self, k) for k in _KEYS}

    def describe(self) -> str:
        given = [f"{k}={v}" for k, v in self.fields().items() if v is not None]
        return ", ".join(given) or "none"


def _number(raw: dict[str, object], key: str) -> float | None:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def read_generation_defaults(directory: Path) -> GenerationDefaults:
    """The defaults of ``directory``/generation_config.json (none when it has no such file).
    ValueError naming the file when it is not a JSON object or a value is not one a request may
    have (a negative temperature, say): requests leaving it out would be refused for it."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return GenerationDefaults()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    top_k, max_new = _number(raw, "top_k"), _number(raw, "max_new_tokens")
    defaults = GenerationDefaults(
        temperature=_number(raw, "temperature"),
        top_p=_number(raw, "top_p"),
        # (vLLM reads top_k 0 as "off", as Duet's -1)
        top_k=None if top_k is None else (int(top_k) if top_k != 0 else -1),
        max_tokens=None if max_new is None else int(max_new),
        min_p=_number(raw, "min_p"),
        repetition_penalty=_number(raw, "repetition_penalty"),
        presence_penalty=_number(raw, "presence_penalty"),
        frequency_penalty=_number(raw, "frequency_penalty"),
    )
    try:
        defaults.as_sampling_params()
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return defaults


def load_generation_defaults(source: str, load_format: str) -> GenerationDefaults:
    """The defaults of the checkpoint ``source`` names: only an HF checkpoint directory has them
    (a GGUF file, the embedded model and random weights have none)."""
    if load_format == "dummy":
        return GenerationDefaults()
    path = checkpoint_path(source)
    return read_generation_defaults(path) if detect_format(path) == "hf" else GenerationDefaults()
