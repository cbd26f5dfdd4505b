"""Streaming detokenization: token ids in, text deltas out, never half a character."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Tokens of the prompt decoded as left context, so the first generated token gets the spacing it has
# in the full text (sentencepiece-style decoders drop a leading space at the start of a decode):
# the fewest, from _PROMPT_CONTEXT_TOKENS on, whose text has no broken character, up to
# _PROMPT_CONTEXT_MAX (vLLM's search). A context that starts inside a character of byte tokens
# (Gemma's and Llama 2's <0xNN>) would make a byte-fallback decoder turn every byte token of the
# run into U+FFFD, generated ones included.
_PROMPT_CONTEXT_TOKENS = 5
_PROMPT_CONTEXT_MAX = 24


class IncrementalDetokenizer:
    """Turns generated token ids, fed one at a time, into text deltas.

    Each step decodes two short windows of ids that start at the same place (``prefix_offset``):
    the part already emitted (up to ``read_offset``) and the same plus the new ids; the delta is the
    difference. While the text ends in U+FFFD, a multi-byte character is still incomplete, so nothing
    is emitted and the ids wait for the next token. The deltas of ``add`` plus ``finish()`` concatenate
    to ``tokenizer.decode(generated_ids, skip_special_tokens)`` when no prompt is given.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # vLLM's spaces_between_special_tokens=False (only where special tokens are kept): an
        # added token right after another generated one is written as its bare content.
        self._bare: dict[int, str] | None = None
        if not (skip_special_tokens or spaces_between_special_tokens):
            self._bare = tokenizer.added_token_texts
        self._last_added = False  # (the prompt's last token never counts, as in vLLM)
        self._ids: list[int] = list(prompt_ids)
        self._num_prompt = len(self._ids)
        self.prefix_offset = self._context_start()
        self.read_offset = self._num_prompt
        self.text = ""  # everything emitted so far

    @property
    def token_ids(self) -> list[int]:
        """The generated ids fed so far (without the prompt)."""
        return self._ids[self._num_prompt :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _context_start(self) -> int:
        """Where the prompt's left context starts (module comment); the shortest window when no
        window is whole (a prompt that ends inside a character)."""
        n = self._num_prompt
        for size in range(_PROMPT_CONTEXT_TOKENS, min(n, _PROMPT_CONTEXT_MAX) + 1):
            if REPLACEMENT_CHAR not in self._decode(self._ids[n - size :]):
                return n - size
        return max(n - _PROMPT_CONTEXT_TOKENS, 0)

    def add(self, token_id: int) -> str:
        """Feed one token; returns the newly completed text (possibly empty)."""
        self._ids.append(int(token_id))
        bare = None
        if self._bare is not None:
            added = self._bare.get(int(token_id))
            # (after an added token nothing is held back: the delta is this token's text alone)
            bare = added if self._last_added else None
            self._last_added = added is not None
        prefix_text, new_text = self._windows()
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :] if bare is None else bare
        self.prefix_offset, self.read_offset = self.read_offset, len(self._ids)
        self.text += delta
        return delta

    def _windows(self) -> tuple[str, str]:
        """The text emitted so far of the window, and the window's whole text. The first ends in
        U+FFFD only where the prompt ends inside a character: a generated token that completes it
        replaces that U+FFFD, so the emitted part is counted without it, and the character goes
        out whole (as vLLM's does; it was lost, the text no longer than before)."""
        prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self._ids[self.prefix_offset :])
        if not new_text.startswith(prefix_text):
            prefix_text = prefix_text.rstrip(REPLACEMENT_CHAR)
        return prefix_text, new_text

    def add_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add(token_id) for token_id in token_ids)

    def finish(self) -> str:
        """The held-back rest at the end of the stream (an incomplete character decodes as U+FFFD)."""
        prefix_text, new_text = self._windows()
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self._ids)
        self.text += delta
        return delta
