"""OpenAI-compatible request bodies (validated at the HTTP edge) and response builders."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


def _none_or(*no_ops: Any) -> Callable[[Any], bool]:
    """A value that asks for nothing: None, or one of ``no_ops``."""
    return lambda v: v is None or any(v == x and type(v) is type(x) for x in no_ops)


# OpenAI request fields Duet does not implement. Each is accepted only with a value that asks for
# nothing (so a client sending the default still works) and refused otherwise, naming it.
_NOT_SUPPORTED_COMMON: dict[str, Callable[[Any], bool]] = {
    "frequency_penalty": _none_or(0, 0.0),
    "presence_penalty": _none_or(0, 0.0),
    "logit_bias": _none_or({}),
    "n": _none_or(1),
    "user": _none_or(),
    "service_tier": _none_or(),
    "store": _none_or(False),
    "metadata": _none_or({}),
}
NOT_SUPPORTED_COMPLETION = _NOT_SUPPORTED_COMMON | {
    "logprobs": _none_or(),  # an int here: 0 still returns the sampled tokens' logprobs
    "best_of": _none_or(1),
    "echo": _none_or(False),
    "suffix": _none_or(""),
}
NOT_SUPPORTED_CHAT = _NOT_SUPPORTED_COMMON | {
    "logprobs": _none_or(False),
    "top_logprobs": _none_or(0),
    "tools": _none_or([]),
    "tool_choice": _none_or("none"),
    "parallel_tool_calls": _none_or(),
    "functions": _none_or([]),
    "function_call": _none_or("none"),
    "response_format": _none_or({"type": "text"}),
    "modalities": _none_or(["text"]),
    "audio": _none_or(),
    "prediction": _none_or(),
    "reasoning_effort": _none_or(),
    "verbosity": _none_or(),
    "web_search_options": _none_or(),
    "prompt_cache_key": _none_or(),
    "safety_identifier": _none_or(),
}
NOT_SUPPORTED_MESSAGE = {
    "name": _none_or(),
    "tool_calls": _none_or([]),
    "tool_call_id": _none_or(),
    "function_call": _none_or(),
    "refusal": _none_or(),
    "audio": _none_or(),
}


def refused_fields(
    extra: dict[str, Any] | None, not_supported: dict[str, Callable[[Any], bool]], where: str = ""
) -> list[tuple[str, str]]:
    """(field, message) for every field of ``extra`` (what a body had beyond the fields Duet
    implements) that must be refused: a known OpenAI field asking for something, or an unknown one."""
    refused = []
    for name, value in (extra or {}).items():
        check = not_supported.get(name)
        if check is None:
            refused.append((where + name, f"{where + name}: unknown field"))
        elif not check(value):
            refused.append((where + name, f"{where + name}: not supported, got {value!r}"))
    return refused


class _SamplingFields(BaseModel):
    """The fields both endpoints implement. Anything else a body has is refused, naming it, unless
    it is an OpenAI field with a value that asks for nothing (``refused_fields``)."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(
        default=None,
        description=(
            "Most tokens to generate; prompt plus max_tokens must fit the model's maximum "
            "length. Default: 16, or what fits."
        ),
    )
    temperature: float = Field(default=1.0, description="0 means greedy.")
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling(self, max_tokens: int) -> SamplingParams:
        """The request's SamplingParams (validated here, once; ValueError names the field)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
        )

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def refused(self) -> list[tuple[str, str]]:
        return refused_fields(self.model_extra, NOT_SUPPORTED_COMPLETION)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request; batches of prompts are refused (one request, one prompt)."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if len(p) == 0:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return list(p)  # type: ignore[arg-type]
        if len(p) == 1:
            return p[0]  # type: ignore[return-value]
        raise ValueError("only one prompt per request is supported")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"only text content parts are supported, got {part.get('type')!r}")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("messages must not be empty")
        return v

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    def refused(self) -> list[tuple[str, str]]:
        refused = refused_fields(self.model_extra, NOT_SUPPORTED_CHAT)
        for i, message in enumerate(self.messages):
            refused += refused_fields(message.model_extra, NOT_SUPPORTED_MESSAGE, f"messages[{i}].")
        return refused


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _envelope(rid: str, obj: str, model: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "logprobs": None, **choice}],
    }


# token_ids in a choice: an extension (as vLLM's return_token_ids) so that models without a tokenizer
# (dummy weights) still give answers that can be checked and benchmarked.


def completion_chunk(
    rid: str, model: str, text: str, finish: str | None, token_ids: list[int]
) -> dict[str, Any]:
    choice = {"text": text, "finish_reason": finish, "token_ids": token_ids}
    return _envelope(rid, "text_completion", model, choice)


def completion_body(
    rid: str, model: str, text: str, finish: str | None, use: dict[str, int], token_ids: list[int]
) -> dict[str, Any]:
    return completion_chunk(rid, model, text, finish, token_ids) | {"usage": use}


def chat_chunk(
    rid: str, model: str, delta: dict[str, Any], finish: str | None, token_ids: list[int]
) -> dict[str, Any]:
    choice = {"delta": delta, "finish_reason": finish, "token_ids": token_ids}
    return _envelope(rid, "chat.completion.chunk", model, choice)


def chat_body(
    rid: str, model: str, text: str, finish: str | None, use: dict[str, int]
) -> dict[str, Any]:
    choice = {"message": {"role": "assistant", "content": text}, "finish_reason": finish}
    return _envelope(rid, "chat.completion", model, choice) | {"usage": use}


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
