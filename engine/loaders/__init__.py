"""Model loading: GGUF (dequantized), HF safetensors directories, and dummy random weights."""

from engine.loaders.dummy import DUMMY_PRESETS, init_dummy_weights
from engine.loaders.load import LoadedModel, load_model, read_model_config
from engine.loaders.source import LOAD_FORMATS, LoadFormat, default_gguf_path
from engine.loaders.tokenizer_only import load_tokenizer

__all__ = [
    "DUMMY_PRESETS",
    "LOAD_FORMATS",
    "LoadFormat",
    "LoadedModel",
    "default_gguf_path",
    "init_dummy_weights",
    "load_model",
    "load_tokenizer",
    "read_model_config",
]
