"""Tokenizers for workloads: a minimal text<->ids interface and the ids random prompts draw from.

The driver never needs the model weights. Random prompts are token ids drawn from the *normal*
tokens of the vocabulary (never special or control tokens such as EOS or chat markers), sent as
`prompt: list[int]`, so their length in tokens is exact. The tokenizer also turns prompts into text
for the chat endpoint and counts the tokens of text datasets; without one, the server's
`usage.prompt_tokens` gives the input lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol


class TokenCodec(Protocol):
    """Text to token ids and back, without special tokens added."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class HFTokenizerCodec:
    """A ``tokenizers.Tokenizer`` (a tokenizer.json) as a TokenCodec."""

    def __init__(self, tokenizer: object) -> None:
        self._tok = tokenizer

    @classmethod
    def from_file(cls, path: str | Path) -> HFTokenizerCodec:
        """From a tokenizer.json, or a checkpoint directory holding one (what `vllm bench serve
        --tokenizer` is given most often)."""
        from tokenizers import Tokenizer

        path = Path(path)
        return cls(Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path)))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)  # type: ignore[attr-defined]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))  # type: ignore[attr-defined]

    def normal_token_ids(self) -> list[int]:
        """Every id of the vocabulary except the special added tokens."""
        added = self._tok.get_added_tokens_decoder()  # type: ignore[attr-defined]
        special = {i for i, tok in added.items() if tok.special}
        return [i for i in range(self._tok.get_vocab_size()) if i not in special]  # type: ignore[attr-defined]


def load_embedded_codec() -> HFTokenizerCodec:
    """The embedded model's tokenizer, rebuilt from its GGUF metadata by the engine's loader.

    Reads metadata only, never the weights (a few seconds on a CPU, mostly parsing the GGUF).
    """
    from gguf import GGUFReader

    from engine.loaders.gguf_tokenizer import tokenizer_from_gguf
    from engine.loaders.source import default_gguf_path

    return HFTokenizerCodec(tokenizer_from_gguf(GGUFReader(str(default_gguf_path()))).backend)
