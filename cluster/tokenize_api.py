"""vLLM's ``/tokenize`` and ``/detokenize``: the server's own tokenizer and chat template over HTTP,
for clients that count or cut prompts before they send them.

``/tokenize`` takes a ``prompt`` (the ids /v1/completions runs for it) or ``messages`` (the ids
/v1/chat/completions runs for them: the same template, options and variables); ``/detokenize``
takes ``tokens``. A field not listed here is refused by name, as on the other endpoints.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, ValidationError

from cluster.http_errors import BadRequest, check_token_ids, validation_message
from cluster.openai_schemas import (
    ADD_SPECIAL_TOKENS_REFUSAL,
    ChatMessage,
    conversation_refusals,
    template_messages,
)
from cluster.openai_unsupported import refused_fields


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None  # (optional, as vLLM's; when given, the served model's name)

    def refused(self) -> list[tuple[str, str]]:
        return refused_fields(self.model_extra, {})


class TokenizePrompt(_Body):
    prompt: str
    add_special_tokens: bool = True  # what the tokenizer adds (BOS), as for a completion
    return_token_strs: bool = False  # also each token's piece in the vocabulary


class TokenizeChat(_Body):
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # (vLLM's: special tokens on top of what the template writes; the chat endpoint adds none)
    add_special_tokens: bool = False
    return_token_strs: bool = False

    def refused(self) -> list[tuple[str, str]]:
        refused = super().refused()
        refused += conversation_refusals(
            self.messages, self.add_generation_prompt, self.continue_final_message
        )
        if self.add_special_tokens:
            refused.append(ADD_SPECIAL_TOKENS_REFUSAL)
        return refused


class Detokenize(_Body):
    tokens: list[int]


def _parse(kind: type[_Body], data: Any) -> _Body:
    try:
        body = kind.model_validate(data)
    except ValidationError as e:
        msg, param = validation_message(e)
        raise BadRequest(msg, param) from e
    refused = body.refused()
    if refused:
        raise BadRequest("; ".join(message for _, message in refused), refused[0][0])
    return body


def add_tokenize_routes(app: FastAPI, backend: Any, check_model: Callable[[str], None]) -> None:
    """``/tokenize`` and ``/detokenize`` on ``app`` (backend: server.ServingBackend);
    ``check_model`` refuses a name other than the served model's."""

    def _tokenizer_needed() -> None:
        if not backend.has_tokenizer:
            raise BadRequest(
                f"model {backend.model_name!r} has no tokenizer (random weights)", "model", 400
            )

    @app.post("/tokenize")
    async def tokenize(data: dict[str, Any]) -> dict[str, Any]:
        chat = "messages" in data
        body = _parse(TokenizeChat if chat else TokenizePrompt, data)
        if body.model is not None:
            check_model(body.model)
        _tokenizer_needed()
        try:
            if isinstance(body, TokenizeChat):
                ids = await asyncio.to_thread(
                    backend.encode_chat,
                    template_messages(body.messages),
                    body.add_generation_prompt,
                    continue_final_message=body.continue_final_message,
                    template_kwargs=body.chat_template_kwargs,
                )
            else:
                assert isinstance(body, TokenizePrompt)
                ids = await asyncio.to_thread(
                    backend.encode, body.prompt, add_special_tokens=body.add_special_tokens
                )
        except (ValueError, TypeError) as e:
            raise BadRequest(str(e), "messages" if chat else "prompt") from e
        assert isinstance(body, TokenizePrompt | TokenizeChat)
        return {
            "count": len(ids),
            "max_model_len": backend.max_model_len,
            "tokens": ids,
            "token_strs": backend.token_pieces(ids) if body.return_token_strs else None,
        }

    @app.post("/detokenize")
    async def detokenize(data: dict[str, Any]) -> dict[str, Any]:
        body = _parse(Detokenize, data)
        assert isinstance(body, Detokenize)
        if body.model is not None:
            check_model(body.model)
        _tokenizer_needed()
        check_token_ids(body.tokens, backend.vocab_size, "tokens")
        return {"prompt": await asyncio.to_thread(backend.decode, body.tokens)}
