"""Load only a model's tokenizer (no weights): what the HTTP front end and the bench driver need."""

from __future__ import annotations

from engine.loaders.hf import config_from_hf_dir
from engine.loaders.hf_tokenizer import tokenizer_from_hf_dir
from engine.loaders.source import LOAD_FORMATS, checkpoint_path, detect_format
from engine.tokenizer import Tokenizer


def load_tokenizer(
    source: str = "default", load_format: str = "auto", has_dummy_config: bool = False
) -> Tokenizer | None:
    """The tokenizer of ``source`` as ``load_model`` would build it; None when the source has none
    (random weights shaped by a dummy config or preset: callers then send token ids)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format {load_format!r} is not supported; expected one of {LOAD_FORMATS}"
        )
    if load_format == "dummy":
        if has_dummy_config:
            return None  # random weights of a given shape: no vocabulary
        try:
            path = checkpoint_path(source)
        except FileNotFoundError:
            return None  # a preset name: random weights, no vocabulary
    else:
        path = checkpoint_path(source)
    if detect_format(path) == "gguf":
        # Imported here: hosts without the gguf package can still serve HF checkpoints.
        from gguf import GGUFReader

        from engine.loaders.gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(GGUFReader(str(path)))
    return tokenizer_from_hf_dir(path, config_from_hf_dir(path))
