"""A tiny, real OpenAI-compatible streaming server for the driver's tests (the Duet cluster has its
own test, tests/cluster/bench/test_bench_cluster.py).

It serves /v1/models, /v1/completions and /v1/chat/completions over real HTTP and SSE, streaming
``max_tokens`` chunks " w0", " w1", ... with `per_token_s` between them, then a usage chunk and
``data: [DONE]``. Its "model" is deterministic, so tests can assert exact outputs:
- prompt tokens = len(prompt) for token ids, the number of words for text;
- max_tokens == 13: answers HTTP 500; max_tokens == 14: the stream stops before [DONE];
- max_tokens == 15: the stream includes an error event;
- max_tokens == 16: two tokens per chunk, with their ``token_ids``, and no usage chunk (a server
  that holds text back and does not report usage).
- max_tokens == 17: vLLM's shape without ``return_token_ids``: a chat stream opens with a chunk
  that names the role (content ""), and every third token's text is empty (a special token).
- max_tokens == 18: Duet's shape: every chunk with its ``token_ids``, then one that only carries
  the finish reason (text "", no ids).
- max_tokens == 19: half a second between the last token chunk and the usage chunk.
With ``api_key`` every route but /metrics answers 401 without ``Authorization: Bearer KEY``.
With ``duet=True`` it also serves /perf_metrics (drained on read; an entry shows ``perf_delay_s``
after its request ended, as Duet's background reports do) with timings derived from the request: prefill_queue_time = 0.001 * prompt tokens, prefill_time = 0.002 * prompt tokens,
transfer_time = 0.0005 * prompt tokens, transfer_bytes = 1000 * prompt tokens,
decode_queue_time = 0.0001 * max_tokens.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL = "tiny-echo"


@dataclass
class EchoState:
    duet: bool
    per_token_s: float
    perf_delay_s: float = 0.0  # an entry shows at /perf_metrics this long after its request ended
    perf: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    num_requests: int = 0
    next_id: int = 0
    prompts: list[Any] = field(default_factory=list)  # every request's prompt, in arrival order
    bodies: list[dict[str, Any]] = field(default_factory=list)  # every request's whole body
    api_key: str | None = None  # then every route but /metrics wants "Authorization: Bearer KEY"


def _prompt_tokens(body: dict[str, Any]) -> int:
    if "messages" in body:
        return sum(len(str(m.get("content", "")).split()) for m in body["messages"])
    prompt = body.get("prompt", "")
    return len(prompt) if isinstance(prompt, list) else len(str(prompt).split())


def build_app(state: EchoState) -> FastAPI:
    app = FastAPI()

    if state.api_key is not None:

        @app.middleware("http")
        async def authenticate(request: Request, call_next: Any) -> Any:
            wanted = f"Bearer {state.api_key}"
            if request.url.path != "/metrics" and request.headers.get("authorization") != wanted:
                return JSONResponse({"error": {"message": "bad API key"}}, status_code=401)
            return await call_next(request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    if state.duet:

        @app.get("/perf_metrics")
        async def perf_metrics() -> list[dict[str, Any]]:
            now = time.monotonic()
            ready = [entry for t, entry in state.perf if t <= now]
            state.perf = [(t, entry) for t, entry in state.perf if t > now]
            return ready

    async def generate(request: Request, chat: bool) -> Any:
        body = await request.json()
        state.num_requests += 1
        state.prompts.append(body.get("prompt", body.get("messages")))
        state.bodies.append(body)
        max_tokens = int(body["max_tokens"])
        if max_tokens == 13:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        state.next_id += 1
        rid = f"cmpl-{state.next_id}"
        prompt_tokens = _prompt_tokens(body)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events() -> AsyncIterator[str]:
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                if max_tokens == 16:
                    for i in range(0, max_tokens, 2):
                        await asyncio.sleep(state.per_token_s)
                        choice = {"index": 0, "text": f" w{i} w{i + 1}", "token_ids": [i, i + 1]}
                        yield f"data: {json.dumps({'id': rid, 'choices': [choice]})}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                if max_tokens == 17 and chat:
                    role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
                    yield f"data: {json.dumps({'id': rid, 'choices': [role]})}\n\n"
                for i in range(max_tokens):
                    await asyncio.sleep(state.per_token_s)
                    if max_tokens == 15 and i == 1:
                        yield f"data: {json.dumps({'error': {'message': 'injected stream error'}})}\n\n"
                        return
                    piece = "" if max_tokens == 17 and i % 3 == 0 else f" w{i}"
                    choice: dict[str, Any] = (
                        {"index": 0, "delta": {"content": piece}}
                        if chat
                        else {"index": 0, "text": piece}
                    )
                    if max_tokens == 18:
                        choice["token_ids"] = [i]
                    yield f"data: {json.dumps({'id': rid, 'choices': [choice]})}\n\n"
                if max_tokens == 18:
                    last = {"index": 0, "text": "", "finish_reason": "length", "token_ids": []}
                    yield f"data: {json.dumps({'id': rid, 'choices': [last]})}\n\n"
                if max_tokens == 14:
                    return
                if max_tokens == 19:
                    await asyncio.sleep(0.5)  # a slow tail: usage and [DONE] come late
                if include_usage:
                    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens}
                    yield f"data: {json.dumps({'id': rid, 'choices': [], 'usage': usage})}\n\n"
                entry = {
                    "request_id": rid,
                    "prefill_queue_time": 0.001 * prompt_tokens,
                    "prefill_time": 0.002 * prompt_tokens,
                    "transfer_time": 0.0005 * prompt_tokens,
                    "transfer_bytes": 1000 * prompt_tokens,
                    "decode_queue_time": 0.0001 * max_tokens,
                }
                state.perf.append((time.monotonic() + state.perf_delay_s, entry))
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await generate(request, chat=True)

    return app


@dataclass
class EchoServer:
    url: str
    state: EchoState
    model: str = MODEL


@contextmanager
def serve_echo(
    duet: bool = True,
    per_token_s: float = 0.001,
    perf_delay_s: float = 0.0,
    api_key: str | None = None,
    port: int = 0,
) -> Iterator[EchoServer]:
    """Run an echo server on ``port`` of 127.0.0.1 (0: a free one) in a thread; stop it on exit."""
    state = EchoState(
        duet=duet, per_token_s=per_token_s, perf_delay_s=perf_delay_s, api_key=api_key
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10.0
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the echo server did not start")
        time.sleep(0.01)
    try:
        yield EchoServer(url=f"http://127.0.0.1:{port}", state=state)
    finally:
        server.should_exit = True
        thread.join(timeout=10.0)
        sock.close()


@pytest.fixture(scope="session")
def duet_server() -> Iterator[EchoServer]:
    """An echo server that also serves /perf_metrics, like Duet."""
    with serve_echo(duet=True) as server:
        yield server


@pytest.fixture(scope="session")
def peer_server() -> Iterator[EchoServer]:
    """An echo server without /perf_metrics, like any other OpenAI-compatible peer."""
    with serve_echo(duet=False) as server:
        yield server


@pytest.fixture
def start_echo() -> Any:
    """``serve_echo`` itself, for a test that needs a server of its own (say, a slow one)."""
    return serve_echo


@pytest.fixture
def free_port() -> int:
    """A 127.0.0.1 port nothing listens on: bound to port 0, read, closed."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = int(sock.getsockname()[1])
    sock.close()
    return port


@pytest.fixture
def word_codec() -> Any:
    """A real `tokenizers` word-level tokenizer: ids 0..9 are words w0..w9, 10 is [UNK], 11 a special [BOS]."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    from cluster.bench.tokens import HFTokenizerCodec

    vocab = {f"w{i}": i for i in range(10)}
    vocab["[UNK]"] = 10
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.add_special_tokens([AddedToken("[BOS]", special=True)])
    return HFTokenizerCodec(tok)
