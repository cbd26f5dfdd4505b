"""A streaming client that stops reading (cluster/bounded_stream.py): at the request's deadline its
answer ends and the request is aborted on its worker, over a real HTTP server and socket whose
buffers fill (the real app over a real decode worker, as test_server.py's)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import uvicorn

from cluster.serve import listening_socket
from cluster.server import create_app
from decode_worker.worker import DecodeWorker
from engine.engine_config import EngineConfig
from engine.engine_core import LLMEngine
from engine.loaders.load import LoadedModel
from tests.cluster.worker_backend import MODEL, WorkerBackend
from worker_common.messages import GenerateRequest, TokenDelta

pytestmark = pytest.mark.timeout(120)

DEADLINE_S = 3.0
SMALL_BUFFER = 4096  # socket buffers on both ends, so a few dozen chunks fill them


class WatchedBackend(WorkerBackend):
    """WorkerBackend whose streams say how they ended: finished, or closed before the end."""

    def __init__(self, worker: DecodeWorker) -> None:
        super().__init__(worker)
        self.request_timeout_s = DEADLINE_S
        self.closed_unfinished: list[str] = []
        self.finished: list[str] = []

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        async def watched() -> AsyncIterator[TokenDelta]:
            ended = False
            try:
                async for delta in super(WatchedBackend, self).generate(request):
                    ended = ended or delta.finish_reason is not None
                    yield delta
            finally:
                (self.finished if ended else self.closed_unfinished).append(request.request_id)

        return watched()


@pytest.fixture
def served(default_model: LoadedModel) -> Iterator[tuple[WatchedBackend, int]]:
    config = EngineConfig(num_pages=64, page_size=16, max_model_len=512, max_num_seqs=4)
    worker = DecodeWorker("d0", LLMEngine.from_loaded(default_model, config), puller=None)
    backend = WatchedBackend(worker)
    sock = listening_socket("127.0.0.1", 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)  # (accepted ones inherit)
    server = uvicorn.Server(uvicorn.Config(create_app(backend), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        yield backend, sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)
        worker.close()
        sock.close()


def test_a_stream_nobody_reads_ends_at_the_deadline_and_aborts_its_request(served) -> None:
    backend, port = served
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": "Once upon a time",
            "max_tokens": 480,  # far more than the deadline leaves time for
            "ignore_eos": True,
            "logprobs": 20,  # big chunks
            "stream": True,
        }
    ).encode()
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
    client.connect(("127.0.0.1", port))
    try:
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        # ... and never read: the server's sends block once the buffers are full.
        limit = time.monotonic() + 60
        while not (backend.closed_unfinished or backend.finished):
            assert time.monotonic() < limit, "the stream was neither ended nor finished"
            time.sleep(0.1)
        assert backend.closed_unfinished and not backend.finished
        # Its choice was aborted on the worker: nothing runs there, no request holds pages.
        while backend.worker.stats().num_running:
            assert time.monotonic() < limit, "the request still runs on the worker"
            time.sleep(0.1)
        assert backend.worker.stats().kv.num_requests == 0
    finally:
        client.close()
