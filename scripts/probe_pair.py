"""Two processes with one UCX endpoint each way, for the UCX probes (probe_ucx_messages.py,
probe_ucx_iov.py): the transceiver's UCX runtime and endpoints, the CPU benchmark's settings."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

from transfer.runtime import UcxRuntime

UCX_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}


def connect_back(conn: Any) -> tuple[UcxRuntime, Any]:
    """In the spawned process: its runtime and its endpoint to the parent."""
    runtime = UcxRuntime.acquire(UCX_ENV)
    conn.send(runtime.worker_address)
    return runtime, runtime.run(runtime.create_endpoint(conn.recv()), timeout=30)


def start_pair(
    sender_main: Callable[[Any, int], None], max_bytes: int
) -> tuple[UcxRuntime, Any, Any, Any]:
    """Spawn ``sender_main(conn, max_bytes)`` (which calls ``connect_back``); return this
    process's runtime, its endpoint to the child, the pipe and the child."""
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=sender_main, args=(child_conn, max_bytes), daemon=True)
    child.start()
    runtime = UcxRuntime.acquire(UCX_ENV)
    peer = conn.recv()
    conn.send(runtime.worker_address)
    return runtime, runtime.run(runtime.create_endpoint(peer), timeout=30), conn, child
