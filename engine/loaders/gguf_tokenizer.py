"""A byte-level BPE tokenizer rebuilt from GGUF metadata (``tokenizer.ggml.*``).

A GGUF file has no tokenizer.json: it lists the tokens, the merges, a type per token and the name
of llama.cpp's pre-tokenizer (``tokenizer.ggml.pre``). We rebuild the same pipeline with the
``tokenizers`` library: split regex per pre-tokenizer, byte-level BPE, byte-level decoder.
"""

from __future__ import annotations

import logging
from functools import cache

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from engine.loaders.gguf_config import gguf_field
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# llama.cpp token types (llama_token_type): 3 = control (special), 4 = user defined (added, not special).
_CONTROL, _USER_DEFINED = 3, 4

# The split regexes of llama.cpp's pre-tokenizers (llama-vocab.cpp), as HF tokenizer.json files spell them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
# GPT-2's own regex (ByteLevel use_regex=True), after each digit is split off on its own.
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_GPT2 = ("default", "gpt-2", "gpt2")


@cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of bytes: printable Latin-1 stays, the other bytes map to 256+."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _spell(token: str, alphabet: frozenset[str]) -> str:
    # Some converters store a token in raw text instead of the byte alphabet; the BPE model needs the latter.
    if set(token) <= alphabet:
        return token
    spelling = byte_to_unicode()
    return "".join(spelling[b] for b in token.encode("utf-8"))


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLIT_BY_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre not in _GPT2:
        logger.warning("GGUF pre-tokenizer %r is not known here; splitting text like GPT-2", pre)
    return byte_level


def tokenizer_from_gguf(reader: GGUFReader) -> Tokenizer:
    kind = gguf_field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported; expected 'gpt2' (byte-level BPE)"
        )
    alphabet = frozenset(byte_to_unicode().values())
    raw_tokens: list[str] = gguf_field(reader, "tokenizer.ggml.tokens")
    tokens = [_spell(t, alphabet) for t in raw_tokens]
    types = gguf_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ")) for m in gguf_field(reader, "tokenizer.ggml.merges")]
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    backend.pre_tokenizer = _pre_tokenizer(gguf_field(reader, "tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    # Control tokens stay whole in text and are skippable on decode; user-defined ones stay whole only.
    # A control token written outside the byte alphabet is a converter's mislabel (as transformers
    # judges it too): matching it in text would need a new id beyond the model's vocabulary.
    backend.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, raw, ty in zip(tokens, raw_tokens, types, strict=True)
            if ty == _CONTROL and t == raw
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _USER_DEFINED
        ]
    )

    def token_of(key: str) -> str | None:
        token_id = gguf_field(reader, f"tokenizer.ggml.{key}", None)
        return tokens[token_id] if token_id is not None and token_id < len(tokens) else None

    bos, eos = token_of("bos_token_id"), token_of("eos_token_id")
    template = []
    if gguf_field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        template.append(bos)
    template.append("$A")
    if gguf_field(reader, "tokenizer.ggml.add_eos_token", False) and eos is not None:
        template.append(eos)
    if len(template) > 1:
        specials = [(t, vocab[t]) for t in dict.fromkeys(template) if t != "$A"]
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join(template), special_tokens=specials
        )
    extra_stops = [
        gguf_field(reader, f"tokenizer.ggml.{k}", None) for k in ("eot_token_id", "eom_token_id")
    ]
    return Tokenizer(
        backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=token_of("unknown_token_id"),
        pad_token=token_of("padding_token_id"),
        chat_template=gguf_field(reader, "tokenizer.chat_template", None),
        extra_stop_token_ids=[int(i) for i in extra_stops if i is not None],
    )
