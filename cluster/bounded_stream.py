"""A streamed HTTP answer whose client must keep reading: each send is bounded by the request's
deadline (``server.request_timeout_s`` from its arrival).

The router's deadline covers the wait for the workers, not a client that stops reading: with the
socket's buffers full, the server's send waits for the client forever, the answer's generator
stays suspended at its ``yield``, and the router's state of the request (its decode worker's
outstanding count, which the load-balancing policies read) with it, whatever the workers do. Here
a send still blocked at the deadline (or ``SEND_GRACE_S`` after its start, if later) ends the
answer: its generator is closed, so the request's cleanup runs as for a client that went away
(every unfinished choice aborted on its worker). The socket is the HTTP server's: ASGI cannot
abort it, so uvicorn logs that the answer was not completed and closes it, which waits for the
client to read what is buffered (at most the transport's 64 KiB) or to go away.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Message, Send

log = logging.getLogger(__name__)

# A send may always take this long, even past the deadline: the router's own timeout error and
# the closing [DONE] then still reach a client that reads.
SEND_GRACE_S = 5.0


class BoundedStreamingResponse(StreamingResponse):
    def __init__(self, content: Any, deadline: float, request_id: str, **kwargs: Any) -> None:
        """``deadline``: a ``time.time()`` after which a send that blocks ends the answer."""
        super().__init__(content, **kwargs)
        self.deadline = deadline
        self.request_id = request_id
        self.stalled = False

    async def stream_response(self, send: Send) -> None:
        async def bounded(message: Message) -> None:
            left = max(self.deadline - time.time(), SEND_GRACE_S)
            try:
                async with asyncio.timeout(left):
                    await send(message)
            except TimeoutError:
                self.stalled = True
                raise

        try:
            await super().stream_response(bounded)
        except TimeoutError:
            if not self.stalled:
                raise
            log.warning(
                "request %s: its client stopped reading the stream; ended at its deadline",
                self.request_id,
            )
            closing = getattr(self.body_iterator, "aclose", None)
            if closing is not None:  # (its cleanup: the unfinished choices are aborted)
                try:
                    async with asyncio.timeout(SEND_GRACE_S):
                        await closing()
                except Exception:
                    log.exception("request %s: closing its answer failed", self.request_id)
