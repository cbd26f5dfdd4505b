"""The Tokenizer of a HF checkpoint directory: tokenizer.json, tokenizer_config.json, chat template, stop ids.

tokenizer.json is used as written, as transformers 4 uses it. transformers 5 does not for classes
with a constructor of their own (LlamaTokenizer, GemmaTokenizer): it keeps the file's vocabulary,
merges and post-processor and rebuilds the normalizer, pre-tokenizer and decoder from the class,
so a Llama-2-style file (a normalizer that prepends "▁" to every segment) encodes a leading space
and the text after special tokens differently there. Tokens that only tokenizer_config.json's
added_tokens_decoder lists are not taken either. (Known; neither is handled yet.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from engine.loaders.hf import read_json
from engine.model_config import ModelConfig
from engine.tokenizer import Tokenizer


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as plain strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _chat_template(directory: Path, tokenizer_config: dict[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        by_name = {t["name"]: t["template"] for t in template}
        return by_name.get("default")
    return template


def tokenizer_from_hf_dir(directory: Path, config: ModelConfig) -> Tokenizer | None:
    """None when the directory has no tokenizer.json (callers then pass token ids)."""
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        return None
    backend = BackendTokenizer.from_file(str(tokenizer_file))
    config_path = directory / "tokenizer_config.json"
    tokenizer_config = read_json(config_path) if config_path.is_file() else {}
    eos = _token_text(tokenizer_config.get("eos_token"))
    if eos is None and config.eos_token_ids:
        eos = backend.id_to_token(config.eos_token_ids[0])
    bos = _token_text(tokenizer_config.get("bos_token"))
    if bos is None and config.bos_token_id is not None:
        bos = backend.id_to_token(config.bos_token_id)
    # Instruct checkpoints list their end-of-turn ids in generation_config.json (Llama 3: <|eot_id|>).
    stops = list(config.eos_token_ids)
    generation_path = directory / "generation_config.json"
    if generation_path.is_file():
        generation_eos = read_json(generation_path).get("eos_token_id")
        stops += [generation_eos] if isinstance(generation_eos, int) else list(generation_eos or [])
    return Tokenizer(
        backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=_token_text(tokenizer_config.get("unk_token")),
        pad_token=_token_text(tokenizer_config.get("pad_token")),
        chat_template=_chat_template(directory, tokenizer_config),
        extra_stop_token_ids=stops,
    )
