"""OpenAI-compatible response bodies and stream chunks: what the HTTP edge sends back (the request
bodies are cluster/openai_schemas.py)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage; ``cached_tokens``: of the prompt tokens, those read from a prefix cache
    rather than computed (always said, as OpenAI's; vLLM's with --enable-prompt-tokens-details)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(frozen=True)
class Head:
    """What every body and chunk of one response carries: its id, when it was created (the
    request's arrival, Unix seconds: the same in every chunk of a stream) and the model."""

    id: str
    created: int
    model: str


@dataclass(frozen=True)
class Ending:
    """How a choice ended: OpenAI's finish_reason, and vLLM's stop_reason (the stop token id or
    stop string that ended it; None for EOS, length, or while it goes on)."""

    finish_reason: str | None = None
    stop_reason: int | str | None = None


GOING_ON = Ending()


def _choice(index: int, payload: dict[str, Any], end: Ending) -> dict[str, Any]:
    ending = {"finish_reason": end.finish_reason, "stop_reason": end.stop_reason}
    return {"index": index, "logprobs": None, **payload, **ending}


def _envelope(head: Head, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": head.id,
        "object": obj,
        "created": head.created,
        "model": head.model,
        "choices": choices,
    }


# token_ids in a choice: an extension (as vLLM's return_token_ids) so that models without a tokenizer
# (dummy weights) still give answers that can be checked and benchmarked.


def completion_choice(
    index: int, text: str, end: Ending, token_ids: list[int], logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return _choice(index, {"text": text, "token_ids": token_ids, "logprobs": logprobs}, end)


def completion_chunk(
    head: Head,
    index: int,
    text: str,
    end: Ending,
    token_ids: list[int],
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice = completion_choice(index, text, end, token_ids, logprobs)
    return _envelope(head, "text_completion", [choice])


# A whole answer names no system fingerprint (null, as vLLM's): no configuration id is kept.
_UNFINGERPRINTED = {"system_fingerprint": None}


def completion_body(
    head: Head, choices: list[dict[str, Any]], use: dict[str, Any]
) -> dict[str, Any]:
    return _envelope(head, "text_completion", choices) | _UNFINGERPRINTED | {"usage": use}


def chat_chunk(
    head: Head,
    index: int,
    delta: dict[str, Any],
    end: Ending,
    token_ids: list[int],
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice = _choice(index, {"delta": delta, "token_ids": token_ids, "logprobs": logprobs}, end)
    return _envelope(head, "chat.completion.chunk", [choice])


def chat_choice(
    index: int,
    text: str,
    end: Ending,
    logprobs: dict[str, Any] | None = None,
    role: str = "assistant",
) -> dict[str, Any]:
    # (what vLLM's message says besides: no refusal, no tool call, no reasoning apart, since Duet
    # parses neither tools nor reasoning out of the text)
    message = {
        "role": role,
        "content": text,
        "refusal": None,
        "tool_calls": [],
        "reasoning_content": None,
    }
    return _choice(index, {"message": message, "logprobs": logprobs}, end)


def chat_body(head: Head, choices: list[dict[str, Any]], use: dict[str, Any]) -> dict[str, Any]:
    return _envelope(head, "chat.completion", choices) | _UNFINGERPRINTED | {"usage": use}


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
