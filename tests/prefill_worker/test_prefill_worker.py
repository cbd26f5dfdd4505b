"""PrefillWorker (the plain class) with a real engine on random weights and a real KVSender: the
ticket is published only after the context is finalized, and every way out gives the pages back."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from engine.request import RequestStatus
from prefill_worker.worker import PrefillError, PrefillWorker
from tests.tiny_engine import greedy, tiny_engine
from transfer import KVSender, TransceiverConfig
from worker_common.messages import GenerateRequest, RequestTimings
from worker_common.request_report import Sink


def make_worker(
    report: Sink | None = None, num_pages: int = 64, host_pages: int = 0
) -> PrefillWorker:
    engine = tiny_engine(num_pages, host_pages)
    specs = list(engine.kv.specs.values())
    return PrefillWorker(
        "p0",
        engine,
        lambda release: KVSender(
            engine.kv.buffers, specs, "tiny", TransceiverConfig(secret="test-secret"), release
        ),
        report,
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


def test_the_result_says_how_much_of_the_prompt_the_prefix_cache_held() -> None:
    """P's prefix hit (OpenAI's cached_tokens, which the router puts on the first delta): none
    for a prompt first seen, its full pages for the same prompt again."""
    worker = make_worker()

    async def main() -> None:
        prompt = list(range(1, 11))  # 10 tokens: two full pages of 4 and a partial one
        first = await worker.prefill(GenerateRequest("a", prompt, greedy(4), time.time()))
        again = await worker.prefill(GenerateRequest("b", prompt, greedy(4), time.time()))
        assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 8)
        for rid in ("a", "b"):
            await worker.cancel(rid)
        await wait_until_no_page_held(worker)

    try:
        asyncio.run(main())
    finally:
        worker.close()


def test_cached_tokens_count_what_came_back_from_the_host_tier() -> None:
    """A prompt whose pages were pushed out of the device pool to the KV host tier: its prefill
    loads them back, and the result counts them as cached (as vLLM counts a connector's hits)."""
    worker = make_worker(num_pages=9, host_pages=32)  # 8 usable device pages of 4 tokens

    async def main() -> None:
        prompt = list(range(1, 11))  # two full pages and a partial one
        await worker.prefill(GenerateRequest("a", prompt, greedy(4), time.time()))
        await worker.cancel("a")
        for i, start in enumerate((20, 40, 60)):  # 5 pages each: "a"'s pages leave the device
            other = list(range(start, start + 18))
            await worker.prefill(GenerateRequest(f"x{i}", other, greedy(4), time.time()))
            await worker.cancel(f"x{i}")
        await wait_until_no_page_held(worker)
        hit = await asyncio.wrap_future(
            worker.loop.call(lambda e: e.kv.match_prefix(prompt + [99]))
        )
        assert hit.num_tokens == 8 and len(hit.host_pages["full"]) == 2  # both from host
        again = await worker.prefill(GenerateRequest("b", prompt, greedy(4), time.time()))
        assert again.num_cached_tokens == 8
        host = (await kv_stats(worker)).groups["full"].host
        assert host is not None and host.loaded_back == 2
        await worker.cancel("b")
        await wait_until_no_page_held(worker)

    try:
        asyncio.run(main())
    finally:
        worker.close()


def test_request_finished_at_its_first_token_publishes_nothing() -> None:
    worker = make_worker()

    async def main() -> None:
        res = await worker.prefill(GenerateRequest("b", list(range(1, 11)), greedy(1), time.time()))
        assert res.ticket is None and res.finish_reason == "length" and res.stop_reason is None
        await wait_until_no_page_held(worker)
        first = res.first_token_id  # (greedy: the same again) as a stop token, it is named
        stop = dataclasses.replace(greedy(4), stop_token_ids=[first])
        res = await worker.prefill(GenerateRequest("c", list(range(1, 11)), stop, time.time()))
        assert (res.ticket, res.finish_reason, res.stop_reason) == (None, "stop", first)
        await wait_until_no_page_held(worker)

    try:
        asyncio.run(main())
    finally:
        worker.close()


def test_a_cancel_during_the_prefill_ends_its_call_at_once() -> None:
    """The router gave up on the request (its client left, its time ran out): the prefill call
    ends now, with an error nobody waits for, instead of holding one of the actor's call slots
    until prefill.prefill_deadline_s (the aborted request made no output to end it)."""
    worker = make_worker()

    async def main() -> None:
        gate = threading.Event()
        worker.loop.call(lambda e: gate.wait(30))  # the engine thread busy: the add queues
        req = GenerateRequest("c", list(range(1, 11)), greedy(4), time.time())
        call = asyncio.ensure_future(worker.prefill(req))
        await asyncio.sleep(0.2)
        cancel = asyncio.ensure_future(worker.cancel("c"))
        await asyncio.sleep(0.2)  # (its abort is queued behind the add, before any step)
        gate.set()
        await cancel
        with pytest.raises(PrefillError, match="the client went away"):
            await asyncio.wait_for(call, 30)  # (the deadline is prefill_deadline_s: 300 s)
        assert worker.stats().num_in_flight == 0
        await wait_until_no_page_held(worker)

    try:
        asyncio.run(main())
    finally:
        worker.close()


def test_a_cancel_that_overtakes_its_prefill_call_leases_nothing() -> None:
    """Ray does not order an async actor's calls: the router's cancel (its client left, its time
    ran out) can run before the prefill call it is about. That call still comes, and ends as one
    the cancel found pending would: aborted and reported, no lease made (the pages used to stay
    leased for nobody until the lease expired, 30 s by default)."""
    records: list[RequestTimings] = []
    worker = make_worker(records.extend)

    async def main() -> None:
        await worker.cancel("o")
        req = GenerateRequest("o", list(range(1, 11)), greedy(4), time.time())
        with pytest.raises(PrefillError, match="the client went away"):
            await asyncio.wait_for(worker.prefill(req), 30)
        assert worker.publisher.leases.get("o") is None
        await wait_until_no_page_held(worker)
        deadline = time.monotonic() + 10
        while not records:
            assert time.monotonic() < deadline, "the request was never reported"
            await asyncio.sleep(0.02)
        assert [(r.request_id, r.finish_reason) for r in records] == [("o", "abort")]
        again = await worker.prefill(req)  # a later call of that id is served (one is kept)
        assert again.ticket is not None
        await worker.cancel("o")
        await wait_until_no_page_held(worker)

    try:
        asyncio.run(main())
    finally:
        worker.close()


def test_a_prefill_call_cancelled_while_its_add_waits_is_still_reported() -> None:
    """The call is cancelled (as Ray cancels an async actor call) while its add waits behind an
    engine step: the add is made and then aborted, so the request is reported (a dropped add left
    it unreported, and the collector, told this attempt's report was the last, lost it)."""
    records: list[RequestTimings] = []
    worker = make_worker(records.extend)

    async def main() -> None:
        gate = threading.Event()
        worker.loop.call(lambda e: gate.wait(30))  # the engine thread busy: the add queues
        req = GenerateRequest("q", list(range(1, 11)), greedy(4), time.time() - 5)
        call = asyncio.ensure_future(worker.prefill(req))
        await asyncio.sleep(0.2)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        gate.set()
        deadline = time.monotonic() + 10
        while not any(r.request_id == "q" for r in records):
            assert time.monotonic() < deadline, "the request was never reported"
            await asyncio.sleep(0.02)
        assert [r.finish_reason for r in records if r.request_id == "q"] == ["abort"]
        # (its latencies count from the router's arrival, 5 s before this worker's)
        ((arrived, here),) = [(r.router_arrival_time, r.arrival_time) for r in records]
        assert arrived == req.arrival_time and here > arrived + 4
        await wait_until_no_page_held(worker)

    try:
        asyncio.run(main())
    finally:
        worker.close()


def test_a_cancel_that_comes_as_the_prefill_ends_gives_the_pages_back_without_a_lease() -> None:
    """The cancel finds the request pending, but its prefill ends before the abort runs: the
    abort leaves the prefilled request alone (it used to free the pages under the coming
    publish, which then failed with a misleading "late release" warning); the call gives the
    pages back itself and ends with an error nobody waits for."""
    worker = make_worker()

    async def main() -> None:
        req = GenerateRequest("e", list(range(1, 11)), greedy(4), time.time())
        call = asyncio.ensure_future(worker.prefill(req))
        await asyncio.sleep(0)  # (its add is queued)
        requests = worker.loop.engine.scheduler.requests
        deadline = time.monotonic() + 10
        # Without yielding to this loop: the call cannot see its output before the cancel runs.
        while getattr(requests.get("e"), "status", None) is not RequestStatus.PREFILLED:
            assert time.monotonic() < deadline, "never prefilled"
            time.sleep(0.001)
        await worker.cancel("e")  # finds it pending; its abort finds it prefilled
        with pytest.raises(PrefillError, match="cancelled: the client went away"):
            await asyncio.wait_for(call, 30)
        await wait_until_no_page_held(worker)

    try:
        asyncio.run(main())
    finally:
        worker.close()


def run_then_close(worker: PrefillWorker, loop: asyncio.AbstractEventLoop, main) -> None:
    """Run ``main()`` on ``loop`` (the tests' engine-thread hooks schedule cancels on it), then
    close both."""
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
        worker.close()


def test_a_cancel_while_the_kv_is_being_leased_gives_the_pages_back_at_once() -> None:
    # The router cancels when the client goes away during a prefill. Between the end of the
    # prefill and the lease there is one call to the engine's loop: a cancel there found neither
    # a prefill to stop nor a lease to end, and the pages stayed pinned for the whole lease.
    worker = make_worker()
    real = worker.loop.engine.kv.page_ids
    cancelled = []

    def page_ids_while_the_client_leaves(rid):  # on the engine's thread
        if rid not in worker._pending and not cancelled:  # the publish's call: in that window
            cancelled.append(asyncio.run_coroutine_threadsafe(worker.cancel(rid), loop))
        return real(rid)

    worker.loop.engine.kv.page_ids = page_ids_while_the_client_leaves

    async def main() -> None:
        res = await worker.prefill(GenerateRequest("a", list(range(1, 11)), greedy(4), time.time()))
        await asyncio.wrap_future(cancelled[0])
        assert res.ticket is not None  # the router drops it: its client is gone
        await wait_until_no_page_held(worker, timeout_s=5.0)  # the lease lasts 30 s
        assert worker.publisher.stats()["expired_leases"] == 0

    loop = asyncio.new_event_loop()
    run_then_close(worker, loop, main)


def test_a_prefill_call_cancelled_while_its_kv_is_being_leased_gives_the_pages_back() -> None:
    # The prefill call itself cancelled (its actor task, say) in that same window: no lease was
    # made, so none would ever end; the pages stayed held for good.
    worker = make_worker()
    real = worker.loop.engine.kv.page_ids
    calls: list[asyncio.Task] = []

    def page_ids_while_the_call_is_cancelled(rid):  # on the engine's thread
        if rid not in worker._pending and calls:  # the publish's call: in that window
            loop.call_soon_threadsafe(calls[0].cancel)
            time.sleep(0.2)  # the cancel lands while this call still runs
        return real(rid)

    worker.loop.engine.kv.page_ids = page_ids_while_the_call_is_cancelled

    async def main() -> None:
        req = GenerateRequest("a", list(range(1, 11)), greedy(4), time.time())
        calls.append(asyncio.ensure_future(worker.prefill(req)))
        with pytest.raises(asyncio.CancelledError):
            await calls[0]
        await wait_until_no_page_held(worker, timeout_s=5.0)  # the lease would last 30 s
        assert worker.publisher.leases.get("a") is None

    loop = asyncio.new_event_loop()
    run_then_close(worker, loop, main)


def test_a_cancel_while_a_publish_fails_is_not_kept_for_a_later_request_of_that_id() -> None:
    worker = make_worker()
    real_ids, real_publish = worker.loop.engine.kv.page_ids, worker.publisher.publish
    cancels, publishes = [], []

    def page_ids(rid):  # the client goes away while the lease is being made
        if rid not in worker._pending and not cancels:
            cancels.append(asyncio.run_coroutine_threadsafe(worker.cancel(rid), loop))
            cancels[0].result(5)
        return real_ids(rid)

    def publish(rid, pages, n):
        publishes.append(rid)
        if len(publishes) == 1:
            raise RuntimeError("no lease today")
        return real_publish(rid, pages, n)

    worker.loop.engine.kv.page_ids = page_ids
    worker.publisher.publish = publish

    async def main() -> None:
        req = GenerateRequest("a", list(range(1, 11)), greedy(4), time.time())
        with pytest.raises(PrefillError, match="no lease today"):
            await worker.prefill(req)
        again = await worker.prefill(req)  # the same id again, and no client left this time
        assert again.ticket is not None and worker.publisher.leases.get("a") is not None
        await worker.cancel("a")
        await wait_until_no_page_held(worker)

    loop = asyncio.new_event_loop()
    run_then_close(worker, loop, main)


def test_a_stalled_prefill_ends_at_prefill_prefill_deadline_s() -> None:
    from cluster.config import config_from_dict
    from cluster.worker_specs import worker_spec
    from worker_common.messages import Role

    config = config_from_dict({"prefill": {"prefill_deadline_s": 0.3}})
    engine = tiny_engine(64)
    specs = list(engine.kv.specs.values())
    worker = PrefillWorker(
        "p0",
        engine,
        lambda release: KVSender(
            engine.kv.buffers, specs, "tiny", TransceiverConfig(secret="test-secret"), release
        ),
        deadlines=worker_spec(config, Role.PREFILL, 0, None, transfer_secret="x").deadlines,
    )

    async def main() -> None:
        task = asyncio.ensure_future(
            worker.prefill(GenerateRequest("a", list(range(1, 11)), greedy(4), time.time()))
        )
        await asyncio.sleep(0)  # the request is queued on the engine's loop...
        worker.loop.call(lambda e: time.sleep(1.5))  # ...which stalls before its first step
        with pytest.raises(PrefillError, match=r"within 0.3s \(prefill.prefill_deadline_s\)"):
            await task
        await wait_until_no_page_held(worker)

    try:
        asyncio.run(main())
    finally:
        worker.close()
