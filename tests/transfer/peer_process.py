"""The other worker of the cross-process tests: a prefill or decode side in a spawned process,
driven over a multiprocessing pipe. Commands are tuples; every reply is plain data.

Each side runs as a worker actor does: its transceiver is made on an event loop of the process's
own (the actor's, in a cluster), which the transfer runtime adopts, and pulls are awaited there.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from tests.transfer.conftest import MODEL, KVSide, config, specs
from transfer import KVReceiver, KVSender


def _state(side: KVSide, stats: dict[str, Any]) -> dict[str, Any]:
    with side.lock:
        side.kv.check_integrity()
    return {
        "released": list(side.released),
        "free": side.free_pages(),
        "initial_free": side.initial_free,
        "stats": stats,
    }


T = TypeVar("T")


def worker_loop() -> asyncio.AbstractEventLoop:
    """A running event loop on a thread of its own: what a worker actor has."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return loop


def made_on(loop: asyncio.AbstractEventLoop, make: Callable[[asyncio.AbstractEventLoop], T]) -> T:
    """``make(loop)`` called on ``loop`` (as an actor's __init__ runs on the actor's loop)."""

    async def call() -> T:
        return make(loop)

    return asyncio.run_coroutine_threadsafe(call(), loop).result(60)


def run_prefill(conn: Connection, seed: int, spec_kwargs: dict, path: str, cfg: dict) -> None:
    """("publish", request_id, num_tokens) -> (ticket, {group: page bytes}); ("state",);
    ("close",)."""
    side = KVSide(specs(**spec_kwargs), seed)
    side.scramble_free_queue()
    sender = made_on(
        worker_loop(),
        lambda loop: KVSender(
            side.kv.buffers, side.specs, MODEL, config(path, **cfg), side.release, loop
        ),
    )
    conn.send(("ready", sender.port))
    while True:
        cmd, *args = conn.recv()
        if cmd == "publish":
            rid, num_tokens = args
            pages = side.allocate(rid, num_tokens)
            sent = {g: t.numpy().tobytes() for g, t in side.pages_of(pages).items()}
            conn.send((sender.publish(rid, pages, num_tokens), sent))
        elif cmd == "state":
            conn.send(_state(side, sender.stats()))
        elif cmd == "close":
            sender.close()
            conn.send(_state(side, sender.stats()))
            return


def run_decode(conn: Connection, seed: int, spec_kwargs: dict, path: str, cfg: dict) -> None:
    """("pull", ticket) starts a pull in the background and answers "started"."""
    side = KVSide(specs(**spec_kwargs), seed)
    side.scramble_free_queue()
    loop = worker_loop()
    receiver = made_on(
        loop, lambda lp: KVReceiver(side.kv.buffers, side.specs, MODEL, config(path, **cfg), lp)
    )
    assert receiver.runtime.loop is loop
    conn.send(("ready", 0))
    while True:
        cmd, *args = conn.recv()
        if cmd == "pull":
            (ticket,) = args
            dst = side.allocate(ticket.request_id, ticket.declared_prompt_len)
            # Awaited on the worker's loop, where the pull runs with no hop to another thread.
            pull = receiver.pull(ticket, dst, 0, ticket.declared_prompt_len)
            asyncio.run_coroutine_threadsafe(pull, loop)
            conn.send("started")
        elif cmd == "close":
            receiver.close()
            conn.send("closed")
            return
