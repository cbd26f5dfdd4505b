"""OpenAI-compatible request bodies (validated at the HTTP edge) and response builders."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    # Unknown fields are ignored like OpenAI's server does for forward compatibility, but the ones we
    # cannot honour (n > 1, logprobs, penalties != 0) are refused rather than silently dropped.
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, description="Maximum number of generated tokens.")
    temperature: float = Field(default=1.0, description="0 means greedy.")
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Any = None
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"only n=1 is supported, got {v}")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError(f"penalties are not supported (must be 0), got {v}")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: Any) -> Any:
        if v not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        return v

    def sampling_dict(self, default_max_tokens: int) -> dict[str, Any]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {
            "max_tokens": self.max_tokens if self.max_tokens is not None else default_max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": stop,
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
        }

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

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
    model_config = ConfigDict(extra="ignore")
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

    def sampling_dict(self, default_max_tokens: int) -> dict[str, Any]:
        d = super().sampling_dict(default_max_tokens)
        if self.max_tokens is None and self.max_completion_tokens is not None:
            d["max_tokens"] = self.max_completion_tokens
        return d


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
