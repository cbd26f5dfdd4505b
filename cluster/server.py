"""The OpenAI-compatible HTTP server (FastAPI): request validation, tokenization, SSE streaming.

The server owns no model state: it turns HTTP bodies into GenerateRequests for the router and the
router's TokenDeltas back into OpenAI bodies (cluster/answers.py: the ``n`` choices, whole or
streamed). Every request is validated here, once, before any worker sees it: a field Duet does not
implement is refused by name (openai_schemas.py), token ids must be in the vocabulary, and the
prompt plus ``max_tokens`` must fit the model. 4xx is for requests the client must fix; 5xx only
for our own faults. A stream that has started ends with an error event and then ``[DONE]``
whatever goes wrong; a client that goes away, streaming or not, aborts its request on every
worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from cluster import openai_responses as resp
from cluster import openai_schemas as oa
from cluster.answers import Answers, Choice, choice_requests, whole_usage
from cluster.api_key_auth import ApiKeyMiddleware
from cluster.body_limit import BodyLimitMiddleware
from cluster.bounded_stream import BoundedStreamingResponse
from cluster.cache_api import add_cache_routes
from cluster.completion_choices import CompletionChoices
from cluster.generate_request import Admitting, prepare_request
from cluster.http_errors import (
    BadRequest,
    install_error_handlers,
    shown,
)
from cluster.openai_logprobs import (
    ContextNames,
    Name,
    chat_logprobs,
    prompt_logprobs,
    prompt_logprobs_volume_problem,
    token_id_name,
)
from cluster.tokenize_api import add_tokenize_routes
from engine.chat_template import content_text
from worker_common.messages import GenerateRequest, TokenDelta

log = logging.getLogger(__name__)

# Most choices one completions request makes (prompts of a batch x n): each is an engine request.
MAX_CHOICES = 1024
# Longest id a client may give its answer (it names the request on every worker and in the stats).
MAX_REQUEST_ID_CHARS = 256


class ServingBackend(Admitting, Protocol):
    """What the server needs from the cluster (cluster.frontend.ClusterFrontend implements it):
    the model's limits the requests are checked against (Admitting), and:"""

    # server.request_timeout_s: a streamed answer whose client stops reading ends then
    request_timeout_s: float

    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def token_text(self, token_id: int) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...
    def token_pieces(self, token_ids: list[int]) -> list[str]: ...
    def decode(self, token_ids: list[int]) -> str: ...
    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]: ...
    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]: ...
    async def abort(self, request_id: str) -> None: ...
    async def reset_prefix_cache(self, host_tier: bool) -> dict[str, bool | str]: ...
    async def health(self) -> dict[str, Any]: ...
    async def metrics_text(self) -> bytes: ...
    async def perf_metrics(self) -> list[dict[str, Any]]: ...
    async def iteration_stats(self) -> list[dict[str, Any]]: ...
    async def transfer_stats(self) -> list[dict[str, Any]]: ...


def _duet_version() -> str:
    """The installed distribution's version (pyproject.toml's), as vLLM's /version says its own."""
    try:
        return importlib.metadata.version("duet")
    except importlib.metadata.PackageNotFoundError:  # (run from a source tree, not installed)
        return "unknown"


def create_app(
    backend: ServingBackend, api_key: str | None = None, max_body_bytes: int | None = None
) -> FastAPI:
    """The OpenAI-compatible app over ``backend``: ``api_key`` None = no authentication;
    ``max_body_bytes`` None = bodies of any size (cluster/body_limit.py)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await backend.start()  # the background stats collection
        try:
            yield
        finally:
            await backend.stop()

    app = FastAPI(title="Duet", version=_duet_version(), lifespan=lifespan)
    started = int(time.time())
    if max_body_bytes is not None:
        app.add_middleware(BodyLimitMiddleware, limit=max_body_bytes)
    # (the key added last, so outermost: a client without it is refused before its body is read)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, key=api_key)

    install_error_handlers(app)

    aborting: set[asyncio.Task[None]] = set()

    def _abort(request_id: str) -> None:
        """Abort ``request_id`` in a task of its own: the caller is being cancelled (the client
        left), and Starlette's cancel scope would cancel an abort awaited there at its first
        await, before a backend that awaits first had acted."""
        task = asyncio.ensure_future(backend.abort(request_id))
        aborting.add(task)
        task.add_done_callback(aborting.discard)

    def _check_model(model: str) -> None:
        if model != backend.model_name:
            raise BadRequest(
                f"model {shown(model)} does not exist; this server serves {backend.model_name!r}",
                "model",
                404,
            )

    def _check_body(body: oa.CompletionRequest | oa.ChatCompletionRequest) -> None:
        if body.model is not None:  # (left out: the served model, as in vLLM)
            _check_model(body.model)
        refused = body.refused()
        if refused:
            raise BadRequest("; ".join(message for _, message in refused), refused[0][0])

    answers = Answers(backend.generate, backend.abort, _abort)

    def _streamed(events: AsyncIterator[str], first: GenerateRequest) -> Response:
        """Server-sent events, each send bounded by the request's deadline (bounded_stream.py)."""
        deadline = first.arrival_time + backend.request_timeout_s
        return BoundedStreamingResponse(
            events, deadline, first.request_id, media_type="text/event-stream"
        )

    def _namer(body: oa.CompletionRequest | oa.ChatCompletionRequest) -> Name:
        """How the answer's logprobs name tokens: their text, or ``token_id:<id>`` (vLLM's
        return_tokens_as_token_ids, for clients that must not re-tokenize)."""
        return token_id_name if body.return_tokens_as_token_ids else backend.token_text

    def _ids(
        prefix: str, body: oa.CompletionRequest | oa.ChatCompletionRequest, request: Request
    ) -> tuple[str, str]:
        """(the answer's id, its requests' id): ``<prefix>-<the client's id>`` when it names one
        (an X-Request-Id header, else the body's request_id: vLLM's rule), else a fresh one. A
        client's id may come twice, so its requests' id gets a unique tail."""
        header = request.headers.get("x-request-id")
        given = header or body.request_id
        if not given:
            rid = resp.new_id(prefix)
            return rid, rid
        if len(given) > MAX_REQUEST_ID_CHARS:
            field = "X-Request-Id" if header else "request_id"
            raise BadRequest(
                f"{field}: at most {MAX_REQUEST_ID_CHARS} characters, got {len(given)}", field
            )
        return f"{prefix}-{given}", resp.new_id(f"{prefix}-{given}")

    @app.get("/health")
    async def health() -> JSONResponse:
        h = await backend.health()
        return JSONResponse(h, status_code=200 if h.get("healthy") else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _duet_version()}

    def _model_card() -> dict[str, Any]:
        return {
            "id": backend.model_name,
            "object": "model",
            "created": started,  # (the server's start, as the model's serving began)
            "owned_by": "duet",
            "max_model_len": backend.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        """OpenAI's retrieve-a-model (the SDK's ``client.models.retrieve(name)``)."""
        _check_model(model)
        return _model_card()

    @app.post("/v1/completions")
    async def completions(body: oa.CompletionRequest, request: Request) -> Response:
        _check_body(body)
        try:
            prompts = body.prompts()
        except (ValueError, TypeError) as e:
            raise BadRequest(str(e), "prompt") from e
        if len(prompts) * body.n > MAX_CHOICES:
            raise BadRequest(
                f"{len(prompts)} prompts x n={body.n} make {len(prompts) * body.n} choices; "
                f"at most {MAX_CHOICES} per request",
                "n",
            )

        def encode_all() -> list[list[int]]:
            return [
                body.truncated(
                    backend.encode(p, add_special_tokens=body.add_special_tokens)
                    if isinstance(p, str)
                    else p,
                    backend.max_model_len,
                )
                for p in prompts
            ]

        try:
            # Tokenizer work runs on a thread, here and in every handler: on the event loop, a
            # 10 MB prompt held every other client (their streams, /health) for about 10 s.
            encoded = await asyncio.to_thread(encode_all)
        except (ValueError, TypeError) as e:  # TypeError: text the tokenizer cannot take
            raise BadRequest(str(e), "prompt") from e
        echo_k = body.logprobs if body.echo else None
        too_much = prompt_logprobs_volume_problem(
            [len(ids) for ids in encoded], body.n, echo_k, body.prompt_logprobs
        )
        if too_much:
            raise BadRequest(too_much, "n")
        # (the response's id; its requests': rid, or prompt k of a batch <rid>-<k>)
        answer_id, rid = _ids("cmpl", body, request)
        firsts = []
        for k, ids in enumerate(encoded):
            try:
                firsts.append(
                    prepare_request(backend, body, ids, rid if len(encoded) == 1 else f"{rid}-{k}")
                )
            except BadRequest as e:  # (which prompt of a batch)
                if len(encoded) == 1 or e.param != "prompt":
                    raise
                raise BadRequest(f"prompt[{k}]: {e}", "prompt") from e
        head = resp.Head(answer_id, int(firsts[0].arrival_time), backend.model_name)
        # (a prompt's choices share its first one's prompt logprobs, whole or streamed)
        reqs = [r for f in firsts for r in choice_requests(f, body.n)]
        texts = [""] * len(prompts)  # (what echo puts first)
        if body.echo:
            for k, (p, ids) in enumerate(zip(prompts, encoded, strict=True)):
                # (a prompt cut by truncate_prompt_tokens: the text of what is left)
                cut = not isinstance(p, str) or body.truncate_prompt_tokens is not None
                texts[k] = backend.decode(ids) if cut else p
        by_text = not body.return_tokens_as_token_ids
        names = ContextNames(
            _namer(body),
            backend.decode if by_text else None,
            backend.token_bytes if by_text else None,
        )
        made = CompletionChoices(body, head, encoded, texts, names)
        n_prompt = sum(len(ids) for ids in encoded)
        if body.stream:
            return _streamed(
                answers.stream(
                    reqs,
                    made.chunk,
                    body.include_usage,
                    n_prompt,
                    None,
                    body.continuous_usage,
                    body.n,
                ),
                reqs[0],
            )

        def build(choices: list[Choice]) -> dict[str, Any]:
            use = whole_usage(n_prompt, choices, body.n)
            return resp.completion_body(head, made.whole(choices), use)

        return await answers.whole(reqs, request, build)

    @app.post("/v1/chat/completions")
    async def chat(body: oa.ChatCompletionRequest, request: Request) -> Response:
        _check_body(body)
        messages = oa.template_messages(body.messages)
        try:
            # (the template takes content parts as it is written to: engine.chat_template)
            ids = await asyncio.to_thread(
                backend.encode_chat,
                messages,
                body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                template_kwargs=body.template_variables,
            )
        except (ValueError, TypeError) as e:  # TypeError: text the tokenizer cannot take
            raise BadRequest(str(e), "messages") from e
        ids = body.truncated(ids, backend.max_model_len)
        answer_id, rid = _ids("chatcmpl", body, request)
        req = prepare_request(backend, body, ids, rid)
        head = resp.Head(answer_id, int(req.arrival_time), backend.model_name)
        reqs = choice_requests(req, body.n)
        asked = req.sampling.logprobs is not None
        name = _namer(body)
        role = body.response_role
        last = messages[-1]  # (its content parts as the template read them)
        # (vLLM's echo: the content of the message the answer goes on with comes first)
        echoed = content_text(last["content"]) if body.echo and last["role"] == role else ""
        if body.stream:

            def make(i: int, d: TokenDelta) -> dict[str, Any]:
                logprobs = chat_logprobs(d.logprobs, name, backend.token_bytes) if asked else None
                # (content "" for a token that holds part of a character, as vLLM's: clients
                # join every chunk's content; only the last chunk may have none)
                ended = d.finish_reason is not None and not d.text
                delta = {} if ended else {"content": d.text}
                end = resp.Ending(d.finish_reason, d.stop_reason)
                return resp.chat_chunk(head, i, delta, end, d.token_ids, logprobs)

            # Each choice's first chunk names the role, as vLLM's; an echo follows in one chunk.
            opening = [{"role": role, "content": ""}] + ([{"content": echoed}] if echoed else [])
            first = [
                resp.chat_chunk(head, i, delta, resp.GOING_ON, [])
                for delta in opening
                for i in range(len(reqs))
            ]
            if body.return_token_ids:  # (vLLM's: in the stream's first chunk only)
                first[0]["prompt_token_ids"] = ids
            return _streamed(
                answers.stream(
                    reqs, make, body.include_usage, len(ids), first, body.continuous_usage, body.n
                ),
                reqs[0],
            )

        def build(choices: list[Choice]) -> dict[str, Any]:
            answer = resp.chat_body(
                head,
                [
                    resp.chat_choice(
                        i,
                        echoed + c.text,
                        c.end,
                        chat_logprobs(c.logprobs, name, backend.token_bytes) if asked else None,
                        role,
                    )
                    for i, c in enumerate(choices)
                ],
                whole_usage(len(ids), choices, body.n),
            )
            if body.return_token_ids:
                answer["prompt_token_ids"] = ids
                for choice, c in zip(answer["choices"], choices, strict=True):
                    choice["token_ids"] = c.token_ids
            if body.prompt_logprobs is not None:  # (vLLM's: beside the choices)
                answer["prompt_logprobs"] = prompt_logprobs(choices[0].prompt_logprobs, name)
            return answer

        return await answers.whole(reqs, request, build)

    add_tokenize_routes(app, backend, _check_model)
    add_cache_routes(app, backend)

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

    @app.get("/transfer_stats")
    async def transfer_stats() -> JSONResponse:
        return JSONResponse(await backend.transfer_stats())

    @app.get("/")
    async def root() -> PlainTextResponse:
        return PlainTextResponse("Duet: OpenAI-compatible API under /v1\n")

    return app
