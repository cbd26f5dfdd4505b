"""Text <-> token ids for the engine: a ``tokenizers.Tokenizer`` plus the model's special tokens and chat template.

Built by the loaders (engine/loaders/hf_tokenizer.py from tokenizer.json, engine/loaders/gguf_tokenizer.py
from GGUF metadata); the engine only uses this class.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

import tokenizers

from engine.chat_template import render_chat_template


class Tokenizer:
    """A fast tokenizer with the ids the engine needs: BOS, EOS and the stop set.

    ``stop_token_ids`` is EOS followed by ``extra_stop_token_ids`` (e.g. Llama 3's ``<|eot_id|>``
    from generation_config.json), without duplicates.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        extra_stop_token_ids: Sequence[int] = (),
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.unk_token = unk_token
        self.pad_token = pad_token
        self.chat_template = chat_template
        self.bos_token_id = self._id_of("bos_token", bos_token)
        self.eos_token_id = self._id_of("eos_token", eos_token)
        stops = ([self.eos_token_id] if self.eos_token_id is not None else []) + [
            int(i) for i in extra_stop_token_ids
        ]
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))
        added_tokens = backend.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(
            token_id for token_id, added in added_tokens.items() if added.special
        )
        # Every added token's text, special or not (what spaces_between_special_tokens=False
        # writes bare; vLLM's fast detokenizer takes the same set).
        self.added_token_texts: dict[int, str] = {
            token_id: added.content for token_id, added in added_tokens.items()
        }

    def _id_of(self, role: str, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{role} {token!r} is not in the vocabulary")
        return token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids including added tokens (may be smaller than the model's padded vocab)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the tokenizer's post-processor adds (BOS for Llama 3)."""
        # (encode_batch of one: the same ids, but the tokenizers library lets go of the GIL
        # while it works, which its encode does not: a server's other threads, its event loop
        # among them, run meanwhile: the HTTP handlers encode on a thread, asyncio.to_thread)
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text as logprobs name it: its decoding, with the leading spaces a
        SentencePiece decoder strips from a lone token (Llama 2's "▁world" is " world") put back,
        as vLLM's convert_ids_list_to_tokens does."""
        text = self.backend.decode([token_id], skip_special_tokens=False)
        piece = self.backend.id_to_token(token_id) or ""
        marks = len(piece) - len(piece.lstrip("▁"))
        spaces = len(text) - len(text.lstrip(" "))
        return " " * max(marks - spaces, 0) + text

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes (OpenAI's logprobs ``bytes``, which let a client join the
        characters that tokens split): its text's UTF-8, but for a token holding part of a
        character, whose lone text is U+FFFD, the bytes its piece stands for (a byte-level BPE
        piece in GPT-2's alphabet, or a SentencePiece byte fallback such as "<0xE2>")."""
        text = self.token_text(token_id)
        piece = self.backend.id_to_token(token_id) or ""
        if "\ufffd" not in text or "\ufffd" in piece:  # (whole characters, or U+FFFD itself)
            return text.encode("utf-8")
        byte = _BYTE_FALLBACK.fullmatch(piece)
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        table = _byte_level_alphabet()
        if piece and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return text.encode("utf-8")

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        variables: dict[str, Any] | None = None,
        content_format: str = "auto",
    ) -> str:
        """The prompt text for ``messages``; encode it with ``add_special_tokens=False`` (the
        template writes BOS itself where the model wants it), or use :meth:`encode_chat`.
        ``chat_template``: a Jinja template to use instead of the model's; ``variables``: template
        variables (``tools``, template flags); ``continue_final_message``: see
        engine.chat_template.render_chat_template, as ``content_format``."""
        source = chat_template if chat_template is not None else self.chat_template
        if source is None:
            raise ValueError(
                "this tokenizer has no chat template; pass a prompt string instead of messages"
            )
        special = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self.unk_token,
            "pad_token": self.pad_token,
        }
        return render_chat_template(
            source,
            messages,
            add_generation_prompt,
            special,
            continue_final_message,
            variables,
            content_format,
        )

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **options: Any
    ) -> list[int]:
        """The prompt's token ids for ``messages`` (``options`` as :meth:`apply_chat_template`)."""
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt, **options),
            add_special_tokens=False,
        )


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """Character -> byte of byte-level BPE pieces (GPT-2's): the printable bytes stand for
    themselves, every other byte for the next unused character from U+0100 on."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in kept}
    others = [b for b in range(256) if b not in set(kept)]
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table
