"""Tokenizer work off the HTTP server's event loop.

Encoding is CPU work that holds up whoever runs it: on the server's event loop, a 10 MB prompt
held every other client (their streams, /health) for about 10 s while it was encoded, before any
length check could refuse it. A request's encoding, chat templating and decoding run on a thread
of the loop's default executor instead, and the loop serves the others meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def off_loop(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on a worker thread, awaited."""
    return await asyncio.to_thread(fn, *args, **kwargs)
