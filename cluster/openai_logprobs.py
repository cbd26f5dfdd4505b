"""Log probabilities in the OpenAI API's two shapes: the completions endpoint's (tokens,
token_logprobs, top_logprobs, text_offset) and the chat endpoint's (a content list of token,
logprob, bytes and top_logprobs). The numbers come from the workers (engine/logprobs.py); tokens are
named here, by the server's tokenizer (``token_id:<id>`` for a model without one, as vLLM's
return_tokens_as_token_ids)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from engine.logprobs import TokenLogprobs

Name = Callable[[int], str]  # token id -> its text


def completion_logprobs(
    entries: Sequence[TokenLogprobs], name: Name, offset: int = 0
) -> dict[str, Any]:
    """The completions endpoint's ``logprobs`` of ``entries``; the first token's text starts at
    character ``offset`` of the answer (a stream's earlier chunks hold the rest)."""
    tokens = [name(e.token_id) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        # the top tokens of each position, and the sampled one (as vLLM's)
        "top_logprobs": [
            {name(t): lp for t, lp in e.top} | {token: e.logprob}
            for e, token in zip(entries, tokens, strict=True)
        ],
        "text_offset": offsets,
    }


def chat_logprobs(entries: Sequence[TokenLogprobs], name: Name) -> dict[str, Any]:
    """The chat endpoint's ``logprobs`` of ``entries``."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        text = name(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            one(e.token_id, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top]}
            for e in entries
        ],
        "refusal": None,
    }
