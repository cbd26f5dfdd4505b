"""``load_model``: one entry point for every model source and load format."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.loaders.dummy import DUMMY_PRESETS, init_dummy_weights
from engine.loaders.fingerprint import checkpoint_fingerprint, dummy_fingerprint
from engine.loaders.hf import config_from_hf_dir, iter_safetensors_weights
from engine.loaders.hf_tokenizer import tokenizer_from_hf_dir
from engine.loaders.source import (
    LOAD_FORMATS,
    LoadFormat,
    checkpoint_path,
    detect_format,
    is_default,
    model_name,
)
from engine.model import PagedCausalLMBase, model_class
from engine.model_config import ModelConfig
from engine.tokenizer import Tokenizer
from engine.tp.context import TPContext


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    model: PagedCausalLMBase
    tokenizer: Tokenizer | None
    """None when the source has no tokenizer (dummy configs): callers pass token ids."""
    name: str
    """What to call the model (e.g. in /v1/models): the checkpoint's file or directory name."""
    fingerprint: str = ""
    """Which weights these are (engine/loaders/fingerprint.py); "" when unknown."""


def load_model(
    source: str = "default",
    load_format: LoadFormat = "auto",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    dummy_config: ModelConfig | dict[str, Any] | None = None,
    seed: int = 0,
    tp: TPContext | None = None,
) -> LoadedModel:
    """Build the model (in eval mode, on ``device``, parameters in ``dtype``) and its tokenizer.

    ``source``: "default" or "" (the embedded SmolLM2 GGUF), a *.gguf file, a HF directory
    (config.json + *.safetensors + tokenizer.json), or with ``load_format="dummy"`` also a name of
    engine.loaders.dummy.DUMMY_PRESETS. ``load_format="auto"`` picks gguf or hf from the path.

    ``dummy``: random weights from ``seed``. The shape is ``dummy_config`` (a ModelConfig, a HF
    config.json dict, or a dict of ModelConfig fields) if given, else the preset named by ``source``,
    else the config of the checkpoint at ``source`` (whose tokenizer then comes along too).

    ``tp``: build and load only this tensor-parallel rank's shard (engine/tp/shard_weights.py);
    safetensors are read slice by slice, other formats one whole tensor at a time.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format {load_format!r} is not supported; expected one of {LOAD_FORMATS}"
        )
    if dummy_config is not None and load_format != "dummy":
        raise ValueError(
            f"dummy_config is only used with load_format='dummy', got load_format={load_format!r}"
        )
    if load_format == "dummy":
        return _load_dummy(source, dtype, device, dummy_config, seed, tp)
    path = checkpoint_path(source)
    actual = detect_format(path)
    if load_format != "auto" and load_format != actual:
        raise ValueError(
            f"model source {source!r} is a {actual} checkpoint, but load_format={load_format!r} was asked for"
        )
    if actual == "gguf":
        return _load_gguf(path, model_name(source, path), dtype, device, tp)
    return _load_hf(path, model_name(source, path), dtype, device, tp)


def _open_gguf(path: Path) -> tuple[Any, ModelConfig, Tokenizer]:
    """(reader, config, tokenizer) of a GGUF file. The gguf package is imported only here: HF and
    dummy loads must work on hosts without it."""
    from gguf import GGUFReader

    from engine.loaders.gguf_config import config_from_gguf
    from engine.loaders.gguf_tokenizer import tokenizer_from_gguf

    reader = GGUFReader(str(path))
    return reader, config_from_gguf(reader), tokenizer_from_gguf(reader)


def _load_gguf(
    path: Path, name: str, dtype: torch.dtype, device: torch.device | str, tp: TPContext | None
) -> LoadedModel:
    from engine.loaders.gguf_weights import iter_gguf_weights

    reader, config, tokenizer = _open_gguf(path)
    model = model_class(config).build(config, dtype, device, _check_tp(config, tp))
    model.load_weights(iter_gguf_weights(reader, config))
    return LoadedModel(config, model, tokenizer, name, checkpoint_fingerprint(path))


def _load_hf(
    path: Path, name: str, dtype: torch.dtype, device: torch.device | str, tp: TPContext | None
) -> LoadedModel:
    config = config_from_hf_dir(path)
    model = model_class(config).build(config, dtype, device, _check_tp(config, tp))
    model.load_weights(iter_safetensors_weights(path, tp.partition if tp else None))
    tokenizer = tokenizer_from_hf_dir(path, config)
    return LoadedModel(config, model, tokenizer, name, checkpoint_fingerprint(path))


def _check_tp(config: ModelConfig, tp: TPContext | None) -> TPContext | None:
    """``tp`` with its partition's shape checked against the checkpoint's (the partition was made
    from the config the caller read before loading)."""
    if tp is not None and tp.partition.config != config:
        raise ValueError("the tensor-parallel partition was made for another model config")
    return tp


def _as_config(value: ModelConfig | dict[str, Any]) -> ModelConfig:
    if isinstance(value, ModelConfig):
        return value
    if isinstance(value, dict):
        return (
            ModelConfig.from_hf_config(value)
            if "model_type" in value
            else ModelConfig.from_dict(value)
        )
    raise TypeError(f"dummy_config must be a ModelConfig or a dict, got {type(value).__name__}")


def read_model_config(
    source: str = "default",
    load_format: LoadFormat = "auto",
    dummy_config: ModelConfig | dict[str, Any] | None = None,
) -> ModelConfig:
    """The shape ``load_model`` would build for these arguments, read without any weight (a
    config.json, a GGUF file's metadata, a dummy config or preset): what checks of a setting
    against the model need before anything is loaded."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format {load_format!r} is not supported; expected one of {LOAD_FORMATS}"
        )
    if load_format == "dummy":
        return _dummy_shape(source, dummy_config, with_tokenizer=False)[0]
    path = checkpoint_path(source)
    if detect_format(path) == "gguf":
        from gguf import GGUFReader

        from engine.loaders.gguf_config import config_from_gguf

        return config_from_gguf(GGUFReader(str(path)))
    return config_from_hf_dir(path)


def _dummy_shape(
    source: str, dummy_config: ModelConfig | dict[str, Any] | None, with_tokenizer: bool
) -> tuple[ModelConfig, str, Tokenizer | None]:
    """(config, name, tokenizer) of a dummy model: its config, a preset, or a checkpoint's shape."""
    if dummy_config is not None:
        return _as_config(dummy_config), "dummy" if is_default(source) else source, None
    if source in DUMMY_PRESETS:
        return DUMMY_PRESETS[source], source, None
    if not is_default(source) and not Path(source).expanduser().exists():
        raise FileNotFoundError(
            f"dummy model source {source!r} is neither a preset {sorted(DUMMY_PRESETS)} nor an existing checkpoint path"
        )
    path = checkpoint_path(source)
    name = model_name(source, path)
    if detect_format(path) == "gguf":
        if with_tokenizer:
            _, config, tokenizer = _open_gguf(path)
            return config, name, tokenizer
        from gguf import GGUFReader

        from engine.loaders.gguf_config import config_from_gguf

        return config_from_gguf(GGUFReader(str(path))), name, None
    config = config_from_hf_dir(path)
    return config, name, tokenizer_from_hf_dir(path, config) if with_tokenizer else None


def _load_dummy(
    source: str,
    dtype: torch.dtype,
    device: torch.device | str,
    dummy_config: ModelConfig | dict[str, Any] | None,
    seed: int,
    tp: TPContext | None,
) -> LoadedModel:
    config, name, tokenizer = _dummy_shape(source, dummy_config, with_tokenizer=True)
    model = model_class(config).build(config, dtype, device, _check_tp(config, tp))
    init_dummy_weights(model, seed)
    return LoadedModel(config, model, tokenizer, name, dummy_fingerprint(config, seed))
