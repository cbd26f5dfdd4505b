"""Helpers for the decode worker's tests: pages held, reports made, a prefill peer that stalls,
a cluster config's decode deadlines."""

from __future__ import annotations

import asyncio
import time

from decode_worker.worker import DecodeWorker
from tests.tiny_engine import PAGE
from worker_common.messages import RequestTimings, WorkerDeadlines


async def held_pages(worker: DecodeWorker) -> int:
    stats = await asyncio.wrap_future(worker.loop.call(lambda e: e.kv.stats()))
    return sum(g.used for g in stats.groups.values())


async def reports(worker: DecodeWorker, records: list[RequestTimings]) -> list[RequestTimings]:
    """What the worker reported so far: its reports are made on the engine thread, in call order."""
    await asyncio.wrap_future(worker.loop.call(lambda e: None))
    return records


async def wait_until_no_page_held(worker: DecodeWorker, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while await held_pages(worker):
        assert time.monotonic() < deadline, "pages still held"
        await asyncio.sleep(0.02)
    await asyncio.wrap_future(worker.loop.call(lambda e: e.kv.check_integrity()))


class StalledPrefill:
    """A prefill worker (it knows the secret, it speaks the protocol) that takes a pull and never
    sends a page: a fill stall on the decode side."""

    def __init__(self, engine, runtime_address: bytes) -> None:  # noqa: ANN001
        import threading

        from tests.transfer.raw_peer import RawServer
        from transfer.messages import PullRequest
        from transfer.page_table import PageTable

        self.table = PageTable.from_specs("tiny", list(engine.kv.specs.values()))
        self.server = RawServer()
        self.release = threading.Event()

        def serve() -> None:
            self.server.accept(b"test-secret", self.table, runtime_address)
            assert isinstance(self.server.recv(), PullRequest)
            self.release.wait(30)

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()

    def ticket(self, rid: str, prompt_len: int):  # noqa: ANN201
        from transfer import TransferTicket

        pages = list(range(1, -(-prompt_len // PAGE) + 1))
        return TransferTicket(
            rid, "127.0.0.1", self.server.port, "rogue", {"full": pages}, {"full": 0},
            prompt_len, self.table.compat_hash, 1, time.time() + 30,
        )  # fmt: skip

    def close(self) -> None:
        self.release.set()
        self.thread.join(10)
        self.server.close()


def deadlines_of(**decode: float) -> WorkerDeadlines:
    """The deadlines a decode worker of a cluster config with these ``decode`` settings gets."""
    from cluster.config import config_from_dict
    from cluster.worker_specs import worker_spec
    from worker_common.messages import Role

    return worker_spec(
        config_from_dict({"decode": decode}), Role.DECODE, 0, None, transfer_secret="x"
    ).deadlines
