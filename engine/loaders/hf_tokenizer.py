"""The Tokenizer of a HF checkpoint directory: tokenizer.json, tokenizer_config.json, chat template, stop ids.

tokenizer.json is used as written, but where transformers 5 departs from the file, as it does for:
- ``LlamaTokenizer`` (Llama 2, Mistral 7B v0.x): transformers 5 keeps the file's vocabulary, merges
  and post-processor and rebuilds the normalizer, pre-tokenizer and decoder from the class, which
  honours tokenizer_config.json's ``legacy`` and ``add_prefix_space`` (transformers 4's fast
  tokenizer ignored ``legacy: false``): a Llama-2 file prepends "▁" to every segment, so after a
  special token ("<s>[INST]") and before a leading space it encodes otherwise. Duet rebuilds them
  the same way (``_class_pipeline``). The other classes of the supported families (GPT2Tokenizer,
  Qwen2Tokenizer, GemmaTokenizer, the plain fast tokenizer) rebuild what their files hold.
- tokenizer_config.json's ``added_tokens_decoder``: tokens it lists that tokenizer.json lacks, or
  lists as special where the file does not, are added as it says (``_config_added_tokens``).
tests/engine/test_hf_tokenizer.py compares both with transformers' AutoTokenizer.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from engine.loaders.hf import read_json
from engine.model_config import ModelConfig
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


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


def _class_pipeline(backend: BackendTokenizer, tokenizer_config: dict[str, Any]) -> None:
    """The normalizer, pre-tokenizer and decoder transformers 5's LlamaTokenizer builds in place of
    the file's: no normalizer; "▁" for spaces, prepended to the text's first segment only (every
    segment with ``legacy: true``; none with ``add_prefix_space: false``), not where it starts with
    one already; decoding strips the one space that prefix becomes."""
    if tokenizer_config.get("tokenizer_class") not in ("LlamaTokenizer", "LlamaTokenizerFast"):
        return
    add_prefix_space = tokenizer_config.get("add_prefix_space")
    add_prefix_space = True if add_prefix_space is None else bool(add_prefix_space)
    legacy = bool(tokenizer_config.get("legacy", False))  # (the class's default)
    scheme = ("always" if legacy else "first") if add_prefix_space else "never"
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme=scheme, split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)


def _config_added_tokens(backend: BackendTokenizer, tokenizer_config: dict[str, Any]) -> None:
    """Add what ``added_tokens_decoder`` lists and the backend lacks (or holds with another
    special flag), in id order, as transformers does."""
    listed = tokenizer_config.get("added_tokens_decoder") or {}
    held = backend.get_added_tokens_decoder()
    for key, spec in sorted(listed.items(), key=lambda item: int(item[0])):
        token_id, content = int(key), spec["content"]
        special = bool(spec.get("special", False))
        current = held.get(token_id)
        if current is not None and (current.content, current.special) == (content, special):
            continue
        token = AddedToken(
            content,
            single_word=bool(spec.get("single_word", False)),
            lstrip=bool(spec.get("lstrip", False)),
            rstrip=bool(spec.get("rstrip", False)),
            normalized=bool(spec.get("normalized", not special)),
            special=special,
        )
        (backend.add_special_tokens if special else backend.add_tokens)([token])
        if backend.token_to_id(content) != token_id:
            log.warning(
                "tokenizer_config.json lists %r as id %d; the tokenizer gives it id %s",
                content,
                token_id,
                backend.token_to_id(content),
            )


def tokenizer_from_hf_dir(directory: Path, config: ModelConfig) -> Tokenizer | None:
    """None when the directory has no tokenizer.json (callers then pass token ids)."""
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        return None
    backend = BackendTokenizer.from_file(str(tokenizer_file))
    config_path = directory / "tokenizer_config.json"
    tokenizer_config = read_json(config_path) if config_path.is_file() else {}
    _class_pipeline(backend, tokenizer_config)
    _config_added_tokens(backend, tokenizer_config)
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
