"""HFTokenizerView: the engine's Tokenizer as transformers' tokenizers are called, for code written
against vLLM's ``LLM.get_tokenizer()`` (which hands out the checkpoint's transformers tokenizer).

The common calls of such code, with transformers' argument order and defaults: ``tok(text)``,
``encode``, ``decode``, ``batch_decode``, ``apply_chat_template(conversation, tools=None, ...,
add_generation_prompt=False, tokenize=True)`` (ids by default, text with ``tokenize=False``),
``convert_ids_to_tokens`` / ``convert_tokens_to_ids``, ``get_vocab``, ``len(tok)`` and the special
tokens and their ids. The engine's own calls keep engine.tokenizer.Tokenizer (``LLM.tokenizer``).
Anything else transformers offers is not here, and fails as a missing attribute.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.tokenizer import Tokenizer

Conversation = list[dict[str, Any]]

# The values of transformers' call options that ask for nothing.
_NOTHING: dict[str, tuple[Any, ...]] = {
    "padding": (False, "do_not_pad"),
    "truncation": (False, None, "do_not_truncate"),
    "return_tensors": (None,),
}


class Encoding(dict[str, Any]):
    """What ``tok(text)`` gives: ``input_ids`` and ``attention_mask``, by key or by attribute,
    as transformers' BatchEncoding."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class HFTokenizerView:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        # (the engine's tokenizer does not change: its special tokens are read once)
        self.bos_token, self.eos_token = tokenizer.bos_token, tokenizer.eos_token
        self.unk_token, self.pad_token = tokenizer.unk_token, tokenizer.pad_token
        self.bos_token_id, self.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
        self.unk_token_id = self._special_id(tokenizer.unk_token)
        self.pad_token_id = self._special_id(tokenizer.pad_token)
        self.chat_template = tokenizer.chat_template

    # ---- text <-> ids ----
    def __call__(
        self, text: str | list[str], add_special_tokens: bool = True, **options: Any
    ) -> Encoding:
        """``input_ids`` (a list, or one per text of a batch) and their all-ones attention mask.
        Padding, truncation and tensors are not offered: ``padding``, ``truncation`` and
        ``return_tensors`` are taken only as asking for none of them."""
        asked = {k: v for k, v in options.items() if v not in _NOTHING.get(k, ())}
        if asked:
            raise ValueError(f"not supported by Duet's tokenizer: {asked}")
        if isinstance(text, str):
            ids: Any = self.encode(text, add_special_tokens)
            mask: Any = [1] * len(ids)
        else:
            ids = [self.encode(t, add_special_tokens) for t in text]
            mask = [[1] * len(i) for i in ids]
        return Encoding(input_ids=ids, attention_mask=mask)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(
        self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False
    ) -> list[str]:
        return [self.decode(s, skip_special_tokens) for s in sequences]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> Any:
        """The vocabulary pieces ("Ġworld"); one for an int, a list for a list."""
        if isinstance(ids, int):
            return self.tokenizer.id_to_token(ids)
        return [self.tokenizer.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Any:
        """Ids of vocabulary pieces (the unknown token's id, or None, for a piece not in it)."""
        if isinstance(tokens, str):
            return self._piece_id(tokens)
        return [self._piece_id(t) for t in tokens]

    def _piece_id(self, piece: str) -> int | None:
        found = self.tokenizer.token_to_id(piece)
        return found if found is not None else self.unk_token_id

    def get_vocab(self) -> dict[str, int]:
        return self.tokenizer.backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.tokenizer.vocab_size  # (added tokens included, as transformers' len)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, added tokens not counted (transformers' ``vocab_size``)."""
        return self.tokenizer.backend.get_vocab_size(with_added_tokens=False)

    # ---- chat ----
    def apply_chat_template(
        self,
        conversation: Conversation | Sequence[Conversation],
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        return_dict: bool = True,
        **template_kwargs: Any,
    ) -> Any:
        """transformers' (5.x) ``apply_chat_template``: the prompt's ids as an Encoding
        (``return_dict=False``: the list; ``tokenize=False``: its text), or the batch's for a
        list of conversations; ``template_kwargs`` are template variables."""
        batch = bool(conversation) and not isinstance(conversation[0], dict)
        conversations = list(conversation) if batch else [conversation]
        variables = dict(template_kwargs)
        if tools is not None:
            variables["tools"] = tools
        if documents is not None:
            variables["documents"] = documents
        out: list[Any] = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(
                list(conv),  # type: ignore[arg-type]
                add_generation_prompt,
                chat_template=chat_template,
                continue_final_message=continue_final_message,
                variables=variables,
            )
            # (the template writes BOS itself where the model wants it)
            out.append(self.encode(text, add_special_tokens=False) if tokenize else text)
        result = out if batch else out[0]
        if not (tokenize and return_dict):
            return result
        mask = [[1] * len(ids) for ids in out] if batch else [1] * len(out[0])
        return Encoding(input_ids=result, attention_mask=mask)

    # ---- special tokens ----
    def _special_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    @property
    def all_special_ids(self) -> list[int]:
        """The named special tokens' ids (BOS, EOS, UNK, PAD), as transformers lists them for a
        checkpoint that names no additional ones (a vocabulary's other added tokens marked
        special, Llama 3's reserved ones say, are not in it there either)."""
        named = [self.bos_token_id, self.eos_token_id, self.unk_token_id, self.pad_token_id]
        return list(dict.fromkeys(i for i in named if i is not None))
