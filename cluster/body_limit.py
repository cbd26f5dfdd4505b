"""The HTTP server's bound on a request body (``server.max_request_body_mb``).

A body is read whole and parsed into Python objects before any handler sees it, and neither
uvicorn nor FastAPI bounds it by default: one client's gigabyte of JSON would take the server's
memory. A body declared larger than the limit is answered at once; one sent in chunks is
counted as it is read, and refused when it passes the limit (the handler raises, so the answer
comes from the app's error handlers, in OpenAI's shape as every other error).

(FastAPI 0.165's own ``max_body_size`` counts the same way, but answers a declared length over
the limit with a plain-text 413 of Starlette's, not OpenAI's error body.)"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.http_errors import error_response


def too_large_message(limit: int) -> str:
    return (
        f"the request body is over this server's limit of {limit / (1 << 20):g} MiB "
        "(server.max_request_body_mb)"
    )


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, too_large_message(limit))


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await error_response(too_large_message(self.limit), 413)(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, counted, send)
