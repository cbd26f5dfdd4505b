"""The OpenAI-compatible HTTP server (FastAPI): request validation, tokenization, SSE streaming.

The server owns no model state: it turns HTTP bodies into GenerateRequests for the router and the
router's TokenDeltas back into OpenAI bodies. 4xx is for requests the client must fix; 5xx only for
our own faults.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError

from cluster import openai_schemas as oa
from engine.worker_messages import GenerateRequest, TokenDelta

log = logging.getLogger(__name__)


class ServingBackend(Protocol):
    """What the server needs from the cluster (the router implements it)."""

    model_name: str
    max_model_len: int
    default_max_tokens: int

    def encode(self, text: str) -> list[int]: ...
    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]: ...
    def validate_sampling(self, sampling: dict[str, Any]) -> None: ...
    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]: ...
    async def abort(self, request_id: str) -> None: ...
    async def health(self) -> dict[str, Any]: ...
    async def metrics_text(self) -> bytes: ...
    async def perf_metrics(self) -> list[dict[str, Any]]: ...
    async def iteration_stats(self) -> dict[str, list[dict[str, Any]]]: ...


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def _err(message: str, code: int, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if code < 500 else "internal_error"
    if code == 401:
        kind = "authentication_error"
    if code == 404:
        kind = "not_found_error"
    return JSONResponse(oa.error_body(message, kind, code, param), status_code=code)


def _validation_message(exc: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    parts, param = [], None
    for e in errs:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        param = param or loc or None
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "; ".join(parts), param


def create_app(backend: ServingBackend, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="Duet", version="0.1.0")

    @app.middleware("http")
    async def _auth(request: Request, call_next):  # type: ignore[no-untyped-def]
        if api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                return _err("invalid or missing API key", 401)
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = _validation_message(exc)
        return _err(msg, 400, param)

    @app.exception_handler(BadRequest)
    async def _on_bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        return _err(str(exc), exc.code, exc.param)

    def _check_model(name: str) -> None:
        if name != backend.model_name:
            raise BadRequest(
                f"model {name!r} does not exist; this server serves {backend.model_name!r}",
                "model",
                404,
            )

    def _prepare(body: oa._SamplingFields, prompt_ids: list[int]) -> GenerateRequest:
        if not prompt_ids:
            raise BadRequest("prompt must not be empty", "prompt")
        sampling = body.sampling_dict(backend.default_max_tokens)
        if len(prompt_ids) >= backend.max_model_len:
            raise BadRequest(
                f"prompt has {len(prompt_ids)} tokens; the maximum model length is {backend.max_model_len} "
                "(prompt plus at least one generated token)",
                "prompt",
            )
        sampling["max_tokens"] = min(
            sampling["max_tokens"], backend.max_model_len - len(prompt_ids)
        )
        try:
            backend.validate_sampling(sampling)
        except ValueError as e:
            raise BadRequest(str(e), getattr(e, "field", None)) from e
        return GenerateRequest(oa.new_id("req"), prompt_ids, sampling, time.time())

    async def _collect(req: GenerateRequest) -> tuple[str, str | None, list[int]]:
        text: list[str] = []
        ids: list[int] = []
        finish = None
        async for d in backend.generate(req):
            if d.error:
                raise RuntimeError(d.error)
            text.append(d.text)
            ids.extend(d.token_ids)
            finish = d.finish_reason or finish
        return "".join(text), finish, ids

    async def _complete(req: GenerateRequest, build: Any) -> Response:
        """A non-streaming answer: collect every delta, then ``build(text, finish, token_ids)``."""
        try:
            text, finish, out_ids = await _collect(req)
        except asyncio.CancelledError:
            await backend.abort(req.request_id)  # the client went away
            raise
        except RuntimeError as e:
            return _err(str(e), 500)
        return JSONResponse(build(text, finish, out_ids))

    async def _stream(
        req: GenerateRequest, request: Request, make_chunk, include_usage: bool, first_chunk=None
    ):  # type: ignore[no-untyped-def]
        rid = req.request_id
        n_out, finished = 0, False
        try:
            if first_chunk is not None:
                yield f"data: {json.dumps(first_chunk)}\n\n"
            async for d in backend.generate(req):
                if d.error:
                    err = oa.error_body(d.error, "internal_error", 500)
                    yield f"data: {json.dumps(err)}\n\n"
                    finished = True
                    break
                n_out += len(d.token_ids)
                if d.text or d.token_ids or d.finish_reason:
                    yield f"data: {json.dumps(make_chunk(d.text, d.finish_reason, d.token_ids))}\n\n"
                if d.finish_reason:
                    finished = True
            if include_usage:
                chunk = make_chunk("", None, [])
                chunk["choices"] = []
                chunk["usage"] = oa.usage(len(req.prompt_token_ids), n_out)
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            # A client that went away mid-stream must not keep pages on any worker.
            if not finished:
                await backend.abort(rid)

    @app.get("/health")
    async def health() -> JSONResponse:
        h = await backend.health()
        return JSONResponse(h, status_code=200 if h.get("healthy") else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": backend.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "duet",
                    "max_model_len": backend.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: oa.CompletionRequest, request: Request) -> Response:
        _check_model(body.model)
        try:
            prompt = body.single_prompt()
        except ValueError as e:
            raise BadRequest(str(e), "prompt") from e
        try:
            ids = backend.encode(prompt) if isinstance(prompt, str) else prompt
        except ValueError as e:
            raise BadRequest(str(e), "prompt") from e
        req = _prepare(body, ids)
        model = backend.model_name
        if body.stream:
            make = lambda text, fin, tids: oa.completion_chunk(
                req.request_id, model, text, fin, tids
            )
            return StreamingResponse(
                _stream(req, request, make, body.include_usage), media_type="text/event-stream"
            )
        return await _complete(
            req,
            lambda text, fin, out: oa.completion_body(
                req.request_id, model, text, fin, oa.usage(len(ids), len(out)), out
            ),
        )

    @app.post("/v1/chat/completions")
    async def chat(body: oa.ChatCompletionRequest, request: Request) -> Response:
        _check_model(body.model)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids = backend.encode_chat(messages)
        except ValueError as e:
            raise BadRequest(str(e), "messages") from e
        req = _prepare(body, ids)
        model = backend.model_name
        if body.stream:
            make = lambda text, fin, tids: oa.chat_chunk(
                req.request_id, model, {"content": text} if text else {}, fin, tids
            )
            first = oa.chat_chunk(
                req.request_id, model, {"role": "assistant", "content": ""}, None, []
            )
            return StreamingResponse(
                _stream(req, request, make, body.include_usage, first),
                media_type="text/event-stream",
            )
        return await _complete(
            req,
            lambda text, fin, out: oa.chat_body(
                req.request_id, model, text, fin, oa.usage(len(ids), len(out))
            ),
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(
            await backend.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.get("/perf_metrics")
    async def perf_metrics() -> JSONResponse:
        return JSONResponse(await backend.perf_metrics())

    @app.get("/iteration_stats")
    async def iteration_stats() -> JSONResponse:
        return JSONResponse(await backend.iteration_stats())

    @app.get("/")
    async def root() -> PlainTextResponse:
        return PlainTextResponse("Duet: OpenAI-compatible API under /v1\n")

    return app
