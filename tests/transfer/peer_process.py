"""The other worker of the cross-process tests: a prefill or decode side in a spawned process,
driven over a multiprocessing pipe. Commands are tuples; every reply is plain data."""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection
from typing import Any

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


def run_prefill(conn: Connection, seed: int, spec_kwargs: dict, path: str, cfg: dict) -> None:
    """("publish", request_id, num_tokens) -> (ticket, {group: page bytes}); ("state",);
    ("close",)."""
    side = KVSide(specs(**spec_kwargs), seed)
    side.scramble_free_queue()
    sender = KVSender(side.kv.buffers, side.specs, MODEL, config(path, **cfg), side.release)
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
    receiver = KVReceiver(side.kv.buffers, side.specs, MODEL, config(path, **cfg))
    conn.send(("ready", 0))
    while True:
        cmd, *args = conn.recv()
        if cmd == "pull":
            (ticket,) = args
            dst = side.allocate(ticket.request_id, ticket.declared_prompt_len)
            threading.Thread(
                target=receiver.pull_blocking,
                args=(ticket, dst, 0, ticket.declared_prompt_len),
                daemon=True,
            ).start()
            conn.send("started")
        elif cmd == "close":
            receiver.close()
            conn.send("closed")
            return
