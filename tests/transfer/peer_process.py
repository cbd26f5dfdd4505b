"""The other worker of the cross-process tests: a prefill or decode side in a spawned process,
driven over a multiprocessing pipe. Commands are tuples; every reply is plain data (bytes, not
tensors)."""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection
from typing import Any

from tests.transfer.conftest import MODEL, KVSide, config, specs
from transfer import KVReceiver, KVSender


def _page_bytes(side: KVSide, pages: dict[str, list[int]]) -> dict[str, bytes]:
    return {g: t.numpy().tobytes() for g, t in side.pages_of(pages).items()}


def _state(side: KVSide, stats: dict[str, Any]) -> dict[str, Any]:
    with side.lock:
        side.kv.check_integrity()
    return {
        "released": list(side.released),
        "free": side.free_pages(),
        "initial_free": side.initial_free,
        "stats": stats,
    }


def run_prefill(
    conn: Connection, seed: int, spec_kwargs: dict[str, Any], cfg_kwargs: dict[str, Any]
) -> None:
    """Commands: ("publish", request_id, num_tokens) -> (ticket, page bytes); ("state",); ("close",).
    ``cfg_kwargs["no_sharing"]`` makes sharing the pools with other processes fail here."""
    cfg_kwargs = dict(cfg_kwargs)
    if cfg_kwargs.pop("no_sharing", False):
        import transfer.ipc

        def refuse(rows: object) -> None:
            raise transfer.ipc.IpcUnavailable("sharing refused by the test")

        transfer.ipc._share_host_pools = refuse
    side = KVSide(specs(**spec_kwargs), seed)
    side.scramble_free_queue()
    sender = KVSender(side.kv.buffers, side.specs, MODEL, config(**cfg_kwargs), side.release)
    conn.send(("ready", sender.port))
    while True:
        cmd, *args = conn.recv()
        if cmd == "publish":
            rid, num_tokens = args
            pages = side.allocate(rid, num_tokens)
            conn.send((sender.publish(rid, pages, num_tokens), _page_bytes(side, pages)))
        elif cmd == "state":
            conn.send(_state(side, sender.stats()))
        elif cmd == "close":
            sender.close()
            conn.send(_state(side, sender.stats()))
            return


def run_decode(
    conn: Connection, seed: int, spec_kwargs: dict[str, Any], cfg_kwargs: dict[str, Any]
) -> None:
    """Commands: ("pull", ticket) starts a pull in the background and answers "started"."""
    side = KVSide(specs(**spec_kwargs), seed)
    side.scramble_free_queue()
    receiver = KVReceiver(side.kv.buffers, side.specs, MODEL, config(**cfg_kwargs))
    conn.send(("ready", 0))
    while True:
        cmd, *args = conn.recv()
        if cmd == "pull":
            (ticket,) = args
            dst = side.allocate(ticket.request_id, ticket.declared_prompt_len)
            thread = threading.Thread(
                target=receiver.pull_blocking,
                args=(ticket, dst, 0, ticket.declared_prompt_len),
                daemon=True,
            )
            thread.start()
            conn.send("started")
        elif cmd == "close":
            receiver.close()
            conn.send("closed")
            return
