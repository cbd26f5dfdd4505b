"""The HTTP server's API key: every request but to the open paths must bear it."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from cluster.http_errors import error_response

# Open without the API key: liveness and Prometheus scrapes (as vLLM leaves them). Everything
# else needs it: the API, and the stats endpoints, which drain what they return.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})


class ApiKeyMiddleware:
    """Refuses requests without ``Authorization: Bearer <key>`` (compared in constant time), but
    to ``OPEN_PATHS``.

    A plain ASGI middleware: Starlette's ``@app.middleware("http")`` would pass every chunk of a
    token stream through a memory stream and a task switch of its own (about a third of the
    front end's time per streamed token in a CPU profile)."""

    def __init__(self, app: ASGIApp, expected: bytes) -> None:
        self.app = app
        self.expected = expected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):  # constant time
                await error_response("invalid or missing API key", 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)
