"""The sampling defaults a checkpoint asks for in its generation_config.json, read as vLLM reads
them (``--generation-config auto``): every key the file sets counts (with transformers 5, whose
``GenerationConfig`` defaults are all unset, vLLM's ``to_diff_dict`` keeps each of them; a file's
top_k 50 is a top_k of 50). A request's own value always wins; these fill only what it leaves out.

What Duet samples with: temperature, top_p, top_k, and ``max_new_tokens`` as the default
max_tokens of a chat request. Keys vLLM would also apply that Duet does not implement
(repetition_penalty, presence_penalty, frequency_penalty, min_p) are returned apart, for the
caller to say so.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from engine.loaders.source import checkpoint_path, detect_format
from engine.sampling_params import SamplingParams

# Keys vLLM applies that Duet does not implement, with the value that asks for nothing
_NOT_IMPLEMENTED = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_p": 0.0,
}


@dataclass(frozen=True)
class GenerationDefaults:
    """What a request leaves out is sampled with these (None: Duet's own default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    # Keys the file sets that Duet does not implement: key -> value
    not_implemented: dict[str, float] = field(default_factory=dict)

    def as_sampling_params(self) -> SamplingParams:
        """SamplingParams' defaults with these in their place (ValueError for a value no request
        may have)."""
        base = SamplingParams()
        return SamplingParams(
            max_tokens=base.max_tokens if self.max_tokens is None else self.max_tokens,
            temperature=base.temperature if self.temperature is None else self.temperature,
            top_p=base.top_p if self.top_p is None else self.top_p,
            top_k=base.top_k if self.top_k is None else self.top_k,
        )

    def describe(self) -> str:
        keys = ("temperature", "top_p", "top_k", "max_tokens")
        given = [f"{k}={getattr(self, k)}" for k in keys if getattr(self, k) is not None]
        return ", ".join(given) or "none"

    def warn_not_implemented(self, logger: logging.Logger) -> None:
        """Say, once per key, what the file asks that requests are sampled without."""
        for key, value in self.not_implemented.items():
            logger.warning(
                "the model's generation_config.json sets %s=%s, which Duet does not implement: "
                "requests are sampled without it (vLLM would apply it)",
                key,
                value,
            )


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
        not_implemented={
            k: v
            for k, neutral in _NOT_IMPLEMENTED.items()
            if (v := _number(raw, k)) is not None and v != neutral
        },
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
