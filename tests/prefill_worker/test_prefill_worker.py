"""PrefillWorker (the plain class) with a real engine on random weights and a real KVSender: the
ticket is published only after the context is finalized, and every way out gives the pages back."""

from __future__ import annotations

import asyncio
import time

from engine.worker_messages import GenerateRequest
from prefill_worker.worker import PrefillWorker
from tests.tiny_engine import greedy, tiny_engine
from transfer import KVSender, TransceiverConfig


def make_worker() -> PrefillWorker:
    engine = tiny_engine(64)
    specs = list(engine.kv.specs.values())
    return PrefillWorker(
        "p0",
        engine,
        lambda release: KVSender(engine.kv.buffers, specs, "tiny", TransceiverConfig(), release),
    )


async def kv_stats(worker: PrefillWorker):  # noqa: ANN201
    return await asyncio.wrap_future(worker.loop.call(lambda e: e.kv.stats()))


async def wait_until_no_page_held(worker: PrefillWorker, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(g.used for g in (await kv_stats(worker)).groups.values()):
        assert time.monotonic() < deadline, "pages still held"
        await asyncio.sleep(0.02)
    await asyncio.wrap_future(worker.loop.call(lambda e: e.kv.check_integrity()))


def test_prefill_leases_committed_pages_until_cancelled() -> None:
    worker = make_worker()

    async def main() -> None:
        prompt = list(range(1, 11))  # 10 tokens: two full pages of 4 and a partial one
        res = await worker.prefill(GenerateRequest("a", prompt, greedy(4), time.time()))
        assert res.ticket is not None and res.finish_reason is None
        assert res.ticket.declared_prompt_len == 10
        assert [len(p) for p in res.ticket.page_ids.values()] == [3]
        stats = await kv_stats(worker)
        assert stats.groups["full"].used == 3  # pinned under the lease
        # Context finalized before the reply: the full pages are already in the prefix index.
        hit = await asyncio.wrap_future(
            worker.loop.call(lambda e: e.kv.match_prefix(prompt + [99]))
        )
        assert hit.num_tokens == 8
        await worker.cancel("a")  # the client went away before any decode worker pulled
        await wait_until_no_page_held(worker)

    try:
        asyncio.run(main())
    finally:
        worker.close()


def test_request_finished_at_its_first_token_publishes_nothing() -> None:
    worker = make_worker()

    async def main() -> None:
        res = await worker.prefill(GenerateRequest("b", list(range(1, 11)), greedy(1), time.time()))
        assert res.ticket is None and res.finish_reason == "length"
        await wait_until_no_page_held(worker)

    try:
        asyncio.run(main())
    finally:
        worker.close()
