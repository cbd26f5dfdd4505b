"""The HTTP edge's errors in OpenAI's shape ({"error": {...}}): the request errors we raise
(BadRequest), the message of a body's validation errors, and the handlers that answer every
error of the app so."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster import openai_responses as resp
from worker_common.prompt_tokens import INT32_MAX


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def error_kind(code: int) -> str:
    """The error's ``type`` for an HTTP status, as vLLM and OpenAI name them."""
    special = {401: "authentication_error", 404: "not_found_error", 504: "timeout_error"}
    return special.get(code, "invalid_request_error" if code < 500 else "internal_error")


def error_response(message: str, code: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(resp.error_body(message, error_kind(code), code, param), status_code=code)


SHOWN_CHARS = 100  # of a client's value quoted back in an error message


def shown(value: str) -> str:
    """``value`` quoted for an error message, cut to its first ``SHOWN_CHARS`` characters (a
    megabyte of model name is not echoed back)."""
    if len(value) <= SHOWN_CHARS:
        return repr(value)
    return f"{value[:SHOWN_CHARS]!r}... ({len(value)} characters)"


MAX_ERRORS_SHOWN = 5  # of a body's validation errors, in its error message


def validation_message(exc: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    """The message of a body's validation errors (the first few: a body of a million bad
    elements is not answered with a million messages) and the field of the first."""
    errs = exc.errors()
    parts, param = [], None
    for e in errs[:MAX_ERRORS_SHOWN]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        if e.get("type") == "json_invalid":  # (its location is a character offset, no field)
            loc = ""
        param = param or loc or None
        msg = str(e.get("msg"))[:300]
        parts.append(f"{loc}: {msg}" if loc else msg)
    if len(errs) > MAX_ERRORS_SHOWN:
        parts.append(f"and {len(errs) - MAX_ERRORS_SHOWN} more")
    return "; ".join(parts), param


def check_token_ids(ids: list[int], vocab_size: int, field: str) -> None:
    """BadRequest naming ``field`` unless every id is in [0, vocab_size) (so also in int32)."""
    if not ids:
        return
    low, high = min(ids), max(ids)
    if low < 0 or high >= min(vocab_size, INT32_MAX + 1):
        bad = low if low < 0 else high
        raise BadRequest(
            f"{field}: token id {bad} is outside the vocabulary [0, {vocab_size})", field
        )


def install_error_handlers(app: FastAPI) -> None:
    """Every error ``app`` answers in OpenAI's shape, as vLLM answers them: a body that fails
    validation, a BadRequest of ours, an unknown route, a wrong method, a body the JSON parser
    gives up on, and a failure of our own."""

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = validation_message(exc)
        return error_response(msg, 400, param)

    @app.exception_handler(BadRequest)
    async def _on_bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        return error_response(str(exc), exc.code, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code)

    # Starlette raises it on after answering, and uvicorn logs it with its traceback. The
    # client is told the kind of failure, not its text: an exception's message may carry
    # paths, addresses or another request's data.
    @app.exception_handler(Exception)
    async def _on_failure(_: Request, exc: Exception) -> JSONResponse:
        return error_response(
            f"internal error ({type(exc).__name__}); the server's log has its details", 500
        )
