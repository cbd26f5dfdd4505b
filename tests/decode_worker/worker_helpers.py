"""Helpers for the decode worker's tests: pages held, reports made, a worker out of pages, a
prefill peer that stalls (and a worker facing it, a pull under way), a cluster config's decode
deadlines."""

from __future__ import annotations

import asyncio
import threading
import time

from decode_worker.worker import DecodeWorker
from tests.tiny_engine import PAGE, greedy, tiny_engine
from transfer import KVReceiver, TransceiverConfig
from worker_common.messages import (
    GenerateRequest,
    PrefillResult,
    RequestTimings,
    WorkerDeadlines,
)


async def held_pages(worker: DecodeWorker) -> int:
    stats = await asyncio.wrap_future(worker.loop.call(lambda e: e.kv.stats()))
    return sum(g.used for g in stats.groups.values())


async def reports(worker: DecodeWorker, records: list[RequestTimings]) -> list[RequestTimings]:
    """What the worker reported so far. Its reports are made on the engine thread at the tick
    after a round of calls, and calls sent back to back share a round: the tick is run here,
    in this call, so that a report of an earlier call is in by its end."""
    await asyncio.wrap_future(worker.loop.call(worker.keeper.tick))
    return records


async def wait_until_no_page_held(worker: DecodeWorker, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while await held_pages(worker):
        assert time.monotonic() < deadline, "pages still held"
        await asyncio.sleep(0.02)
    await asyncio.wrap_future(worker.loop.call(lambda e: e.kv.check_integrity()))


def out_of_pages(records: list[RequestTimings]) -> DecodeWorker:
    """A worker of 7 usable pages of 4 tokens that waits up to 30 s for pages (``hog_all``
    takes them all), reporting into ``records``."""
    engine = tiny_engine(8)
    receiver = KVReceiver(
        engine.kv.buffers, list(engine.kv.specs.values()), "tiny", TransceiverConfig(secret="s")
    )
    return DecodeWorker(
        "d0", engine, receiver, report=records.extend, deadlines=WorkerDeadlines(page_wait_s=30)
    )


async def hog_all(worker: DecodeWorker) -> None:
    """Every page held by the request "hog" (``e.kv.free("hog")`` gives them back)."""
    assert await asyncio.wrap_future(
        worker.loop.call(lambda e: e.kv.allocate_slots("hog", 7 * PAGE))
    )


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


STALL_PULL_DEADLINE_S = 1.0


def facing_a_stall(
    records: list[RequestTimings], on_failure: str = "fail"
) -> tuple[DecodeWorker, StalledPrefill]:
    """A decode worker (KV over UCX, a pull deadline of ``STALL_PULL_DEADLINE_S``) reporting into
    ``records``, and a prefill peer of it that takes a pull and never sends a page."""
    engine = tiny_engine(64)
    cfg = TransceiverConfig(
        secret="test-secret",
        direct_copy=False,
        pull_deadline_s=STALL_PULL_DEADLINE_S,
        chunk_deadline_s=0.5,
    )
    receiver = KVReceiver(engine.kv.buffers, list(engine.kv.specs.values()), "tiny", cfg)
    worker = DecodeWorker("d0", engine, receiver, records.extend, on_failure=on_failure)
    return worker, StalledPrefill(engine, receiver.runtime.worker_address)


async def pull_under_way(
    worker: DecodeWorker, stalled: StalledPrefill, prompt: list[int]
) -> asyncio.Task[None]:
    """Decode request "x" from the stalled peer; return its task once its pull is in flight."""
    req = GenerateRequest("x", prompt, greedy(6), time.time())
    pre = PrefillResult("x", 5, "", None, ticket=stalled.ticket("x", len(prompt)))

    async def consume() -> None:
        async for _ in worker.decode(req, pre):
            pass

    task = asyncio.ensure_future(consume())
    deadline = time.monotonic() + 10
    while not worker.stats().num_in_flight:
        assert time.monotonic() < deadline and not task.done()
        await asyncio.sleep(0.02)
    return task


async def pull_failed_behind_a_step(
    worker: DecodeWorker, task: asyncio.Task[None], step_ends: threading.Event
) -> None:
    """With a pull under way (``task``, from ``pull_under_way`` facing a stall): a long engine
    step queued (it ends when ``step_ends`` is set), and back once the pull has failed, so that
    the free of its pages waits behind that step."""
    worker.loop.call(lambda e: step_ends.wait(30))
    deadline = time.monotonic() + 10
    while worker.stats().num_in_flight:
        assert time.monotonic() < deadline and not task.done()
        await asyncio.sleep(0.02)
