"""Log probabilities in the OpenAI API's two shapes: the completions endpoint's (tokens,
token_logprobs, top_logprobs, text_offset) and the chat endpoint's (a content list of token,
logprob, bytes and top_logprobs). The numbers come from the workers (engine/logprobs.py); tokens are
named here, by the server's tokenizer (``token_id:<id>`` for a model without one, as vLLM's
return_tokens_as_token_ids)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from engine.logprobs import TokenLogprobs, as_vllm

Name = Callable[[int], str]  # token id -> its text
Decode = Callable[[list[int]], str]  # token ids -> their text

INCOMPLETE = "\ufffd"  # what a token holding part of a character decodes to alone, at its end
CONTEXT = 4  # tokens before one that completes a character: a UTF-8 character has <= 4 bytes


# Most prompt logprob entries (tokens x (k + 1)) one completions answer may carry: each choice
# repeats its prompt's, so a 3 KB request (4 prompts x n=128, echo, logprobs 20, ~400 tokens)
# built a 376 MB answer in 46 s. 2M entries is ~100 MB of JSON; an eval's echo of thousands of
# prompt tokens with logprobs 1 to 5 stays far below it.
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 21


def prompt_logprobs_volume_problem(
    prompt_lens: Sequence[int], n: int, echo_k: int | None, prompt_k: int | None
) -> str:
    """ "" or why the answer's prompt logprobs would be too large: every choice carries its
    prompt's (``echo_k``: echo with logprobs; ``prompt_k``: prompt_logprobs), each token with
    its k most likely."""
    per_token = sum(k + 1 for k in (echo_k, prompt_k) if k is not None)
    entries = sum(prompt_lens) * n * per_token
    if entries <= MAX_PROMPT_LOGPROB_ENTRIES:
        return ""
    return (
        f"the answer would carry {entries} prompt logprob entries ({sum(prompt_lens)} prompt "
        f"tokens x n={n} x {per_token} per token); at most {MAX_PROMPT_LOGPROB_ENTRIES}: ask "
        "fewer choices, fewer logprobs or shorter prompts"
    )


def token_id_name(token_id: int) -> str:
    """A token named by its id (vLLM's return_tokens_as_token_ids form)."""
    return f"token_id:{token_id}"


def _finite(logprob: float) -> float:
    """JSON has no -inf: a token the model rules out is -9999.0 (OpenAI's and vLLM's value); so
    is a NaN (not ``max``, which keeps a NaN it is given first), which no JSON parser takes."""
    return logprob if logprob >= -9999.0 else -9999.0


def _whole_characters(text: str) -> str:
    """``text`` without the incomplete character its last token left at its end."""
    return text[:-1] if text.endswith(INCOMPLETE) else text


def text_added(before: list[int], token_id: int, decode: Decode) -> str:
    """The whole characters ``token_id`` adds to the text of the tokens ``before`` it (the last
    ``CONTEXT`` or fewer): "" for a token that starts or continues a character, the character
    for the one that completes it. (A ``before`` that starts inside a character decodes to the
    same replacement characters with the token as without it: they cancel.)"""
    head = _whole_characters(decode(before))
    text = _whole_characters(decode([*before, token_id]))
    return text[len(head) :] if text.startswith(head) else ""


class ContextNames:
    """Tokens named as the completions endpoint's logprobs name them: by their own text, but a
    token holding part of a character (whose own text ends in U+FFFD) by the whole characters it
    adds after the tokens before it, so that the tokens join into the answer's text and
    ``text_offset`` counts its characters (vLLM corrects such tokens too; each was "\ufffd",
    and an answer of 3 emoji had offsets up to 7). ``decode`` None: names alone."""

    def __init__(
        self, name: Name, decode: Decode | None, token_bytes: Callable[[int], bytes] | None = None
    ) -> None:
        self.name = name
        self.decode = decode
        self.token_bytes = token_bytes

    def __call__(self, token_id: int, seq: Sequence[int], at: int) -> str:
        """``token_id`` at position ``at`` of ``seq``, after ``seq[:at]`` (only the last
        ``CONTEXT`` of them are read, and only for a token holding part of a character)."""
        own = self.name(token_id)
        if self.decode is None or not own.endswith(INCOMPLETE):
            return own
        return text_added(list(seq[max(0, at - CONTEXT) : at]), token_id, self.decode)

    def alternative(self, token_id: int, seq: Sequence[int], at: int) -> str:
        """A top token other than the one taken, at position ``at``: named as that one would be,
        but one that adds no whole character there by its bytes, as OpenAI names them
        (``bytes:\\xe4\\xbd``): such tokens would all be "" and collide in ``top_logprobs``."""
        named = self(token_id, seq, at)
        if named or self.token_bytes is None:
            return named
        return "bytes:" + "".join(f"\\x{b:02x}" for b in self.token_bytes(token_id))


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[TokenLogprobs | None],
    names: ContextNames,
    offset: int = 0,
    before: Sequence[int] = (),
) -> dict[str, Any]:
    """The completions endpoint's ``logprobs`` of ``token_ids``, each with its entry (None: a
    token without one, an echoed prompt's first: its logprob and top tokens are null); the first
    token's text starts at character ``offset`` of the answer, after the tokens ``before`` (a
    stream's earlier chunks hold the rest)."""
    seq = [*before[-CONTEXT:], *token_ids]
    start = len(seq) - len(token_ids)
    tokens = [names(t, seq, start + i) for i, t in enumerate(token_ids)]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else _finite(e.logprob) for e in entries],
        # the top tokens of each position (named after the same tokens), and the sampled one
        # (as vLLM's)
        "top_logprobs": [
            None
            if e is None
            else {
                token if t == taken else names.alternative(t, seq, start + i): _finite(lp)
                for t, lp in e.top
            }
            | {token: _finite(e.logprob)}
            for i, (e, token, taken) in enumerate(zip(entries, tokens, token_ids, strict=True))
        ],
        "text_offset": offsets,
    }


def computed(
    entries: Sequence[TokenLogprobs | None] | None,
) -> Sequence[TokenLogprobs | None]:
    """The prompt logprobs a worker sent for a request that asked for them (none: our fault)."""
    if entries is None:
        raise RuntimeError("the prompt's logprobs did not come back from the worker")
    return entries


def prompt_logprobs(entries: Sequence[TokenLogprobs | None] | None, name: Name) -> list[Any]:
    """vLLM's ``prompt_logprobs`` of an answer: per prompt token null (the first) or token id ->
    its logprob, rank and text, the prompt's own token first."""
    return [
        None
        if e is None
        else {
            str(token): {
                "logprob": _finite(logprob.logprob),
                "rank": logprob.rank,
                "decoded_token": logprob.decoded_token,
            }
            for token, logprob in as_vllm(e, name).items()
        }
        for e in computed(entries)
    ]


def chat_logprobs(
    entries: Sequence[TokenLogprobs], name: Name, token_bytes: Callable[[int], bytes]
) -> dict[str, Any]:
    """The chat endpoint's ``logprobs`` of ``entries``; each token's ``bytes`` its own (a token
    holding part of a character is named U+FFFD, whose bytes would not join into it)."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        return {
            "token": name(token),
            "logprob": _finite(logprob),
            "bytes": list(token_bytes(token)),
        }

    return {
        "content": [
            one(e.token_id, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top]}
            for e in entries
        ],
        "refusal": None,
    }
