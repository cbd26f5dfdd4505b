"""DecodeWorker (the plain class) with a real engine on random weights: a client that goes away never
leaves pages held, whether it leaves mid-stream or while its request still waits for pages, and
every request the worker was handed is reported once, even one that never reached its engine."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import pytest

from decode_worker.worker import DecodeWorker
from tests.decode_worker.worker_helpers import (
    held_pages,
    hog_all,
    out_of_pages,
    reports,
    wait_until_no_page_held,
)
from tests.tiny_engine import greedy, tiny_engine
from worker_common.messages import (
    GenerateRequest,
    PrefillResult,
    RequestTimings,
    TokenDelta,
)


def test_local_generate_streams_and_frees_on_disconnect() -> None:
    worker = DecodeWorker("d0", tiny_engine(64), puller=None)

    async def main() -> None:
        full = [
            d
            async for d in worker.generate(
                GenerateRequest("a", list(range(1, 11)), greedy(6), time.time())
            )
        ]
        assert sum(len(d.token_ids) for d in full) == 6 and full[-1].finish_reason == "length"
        stream = worker.generate(GenerateRequest("b", list(range(1, 11)), greedy(100), time.time()))
        first = await stream.__anext__()
        assert first.token_ids
        await stream.aclose()  # the client went away mid-stream
        await wait_until_no_page_held(worker)

    try:
        asyncio.run(main())
    finally:
        worker.close()


def test_a_request_whose_call_never_ran_is_reported_once_and_a_late_call_ends_at_once() -> None:
    """The router's cancel can stop a decode call before it runs; its abort then says how long
    the prompt was: the worker reports the request as aborted (nothing else would), and a call
    for it that still comes streams nothing and takes no page. An abort for a request whose call
    did run is the usual one: its one report comes from the engine."""
    records: list[RequestTimings] = []
    worker = DecodeWorker("d0", tiny_engine(64), None, records.extend)

    async def main() -> None:
        await worker.abort("never", prompt_tokens=10)
        (gone,) = await reports(worker, records)
        assert (gone.request_id, gone.finish_reason, gone.prompt_tokens) == ("never", "abort", 10)
        # Handed off by a prefill worker (its report waits for this one): not the last report.
        # One this worker was to prefill itself is (no prefill worker saw it; the collector
        # waited for one before).
        await worker.abort("never-local", prompt_tokens=3, local=True, prefill_attempt=1)
        assert [r.last_report for r in await reports(worker, records)] == [False, True]
        # The router's attempt goes with it: the collector joins by it (here: one had failed).
        assert [r.prefill_attempt for r in await reports(worker, records)] == [0, 1]
        late = GenerateRequest("never", list(range(1, 11)), greedy(4), time.time())
        assert [d async for d in worker.generate(late)] == []
        assert await held_pages(worker) == 0

        stream = worker.generate(
            GenerateRequest("ran", list(range(1, 11)), greedy(100), time.time())
        )
        assert (await stream.__anext__()).token_ids
        await worker.abort("ran", prompt_tokens=10)  # its call ran: the usual abort
        await stream.aclose()  # (as the router's cancel closes it)
        await wait_until_no_page_held(worker)
        deadline = time.monotonic() + 10  # (the engine's report goes out on a later loop tick)
        while not any(r.request_id == "ran" for r in await reports(worker, records)):
            assert time.monotonic() < deadline, "the engine never reported the aborted request"
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # a second report, if there were one, would come meanwhile
        ran = [r for r in await reports(worker, records) if r.request_id == "ran"]
        assert [r.finish_reason for r in ran] == ["abort"] and ran[0].output_tokens > 0

    try:
        asyncio.run(main())
    finally:
        worker.close()


@pytest.mark.timeout(60)
def test_a_request_the_engine_ends_before_this_side_looks_keeps_every_token() -> None:
    """The engine thread may run a short request to its end before the worker's loop resumes
    after adding it: every token still reaches the caller. (The worker used to look at the live
    request then, see it finished, and end the stream with none of the tokens the engine had
    already streamed: answers cut to their first token under load.)"""
    worker = DecodeWorker("d0", tiny_engine(64), puller=None)

    async def main() -> list[TokenDelta]:
        stream = worker.generate(GenerateRequest("a", list(range(1, 9)), greedy(4), time.time()))
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # the stream starts: its add is queued on the engine thread
        time.sleep(1.0)  # hold this loop while the engine runs the request to its end
        return [await first] + [d async for d in stream]

    try:
        deltas = asyncio.run(main())
        assert sum(len(d.token_ids) for d in deltas) == 4
        assert deltas[-1].finish_reason == "length"
    finally:
        worker.close()


@pytest.mark.timeout(120)
def test_disconnect_while_waiting_for_pages_leaves_nothing_held() -> None:
    records: list[RequestTimings] = []
    worker = out_of_pages(records)

    async def main() -> None:
        await hog_all(worker)
        req = GenerateRequest("x", list(range(1, 13)), greedy(4), time.time())
        pre = PrefillResult(
            "x", 5, "", None, ticket=None
        )  # never reached: gen-init waits for pages

        async def consume() -> None:
            async for _ in worker.decode(req, pre):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.3)
        assert not task.done()  # waiting in gen-init
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wrap_future(worker.loop.call(lambda e: e.kv.free("hog")))
        await asyncio.sleep(0.2)
        await wait_until_no_page_held(worker)
        assert not await asyncio.wrap_future(worker.loop.call(lambda e: e.kv.has_request("x")))
        # The engine never saw it; the worker still reports its end, as an abort.
        ((rid, finish, path),) = [
            (r.request_id, r.finish_reason, r.transfer_path) for r in await reports(worker, records)
        ]
        assert (rid, finish, path) == ("x", "abort", None)

    try:
        asyncio.run(main())
    finally:
        worker.close()


@pytest.mark.timeout(120)
def test_an_abort_while_waiting_for_pages_ends_the_request_without_a_pull() -> None:
    """The abort comes while the request waits for pages (not a cancel of its call: a caller
    that only calls ``abort``): it stops waiting at once, takes no page, pulls nothing, streams
    nothing and is reported as aborted. (The abort used to be dropped: the request went on.)"""
    records: list[RequestTimings] = []
    worker = out_of_pages(records)

    async def main() -> None:
        await hog_all(worker)
        req = GenerateRequest("x", list(range(1, 13)), greedy(4), time.time())
        pre = PrefillResult("x", 5, "", None, ticket=None)  # a pull of it would fail

        async def consume() -> list[TokenDelta]:
            return [d async for d in worker.decode(req, pre)]

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.3)
        assert not task.done()  # waiting in gen-init
        await worker.abort("x")
        # It ends at once, without the pages (not at the page deadline, as an error).
        assert await asyncio.wait_for(task, 5) == []
        assert await held_pages(worker) == 7  # the hog's only
        await asyncio.wrap_future(worker.loop.call(lambda e: e.kv.free("hog")))
        await wait_until_no_page_held(worker)
        assert worker.stats().transfer.failures == 0  # no pull was made
        ((rid, finish),) = [(r.request_id, r.finish_reason) for r in await reports(worker, records)]
        assert (rid, finish) == ("x", "abort")

    try:
        asyncio.run(main())
    finally:
        worker.close()


def test_an_abort_of_a_running_request_ends_its_stream_and_frees_its_pages() -> None:
    """The router's abort of a request decoding here (its client left; another worker took it)
    ends the call's stream now, not at decode.token_deadline_s (the engine frees an aborted
    request and makes no output of it, so the stream used to wait for one)."""
    records: list[RequestTimings] = []
    worker = DecodeWorker("d0", tiny_engine(64), None, records.extend)

    async def main() -> None:
        req = GenerateRequest("a", list(range(1, 11)), greedy(200), time.time())
        stream = worker.generate(req)
        first = await stream.__anext__()
        assert first.error is None and first.finish_reason is None
        await worker.abort("a")
        rest = await asyncio.wait_for(_drain(stream), 60)  # (the token deadline is 300 s)
        assert rest and rest[-1].error == "aborted by the router"
        await wait_until_no_page_held(worker)
        ((rid, finish, arrived),) = [
            (r.request_id, r.finish_reason, r.router_arrival_time)
            for r in await reports(worker, records)
        ]
        assert (rid, finish, arrived) == ("a", "abort", req.arrival_time)

    try:
        asyncio.run(main())
    finally:
        worker.close()


async def _drain(stream: AsyncIterator[TokenDelta]) -> list[TokenDelta]:
    return [d async for d in stream]


def test_a_client_gone_while_its_add_waits_behind_a_step_is_still_reported() -> None:
    """The call ran, so the router's abort does not report it (the worker's own records must):
    its add, queued behind the engine's work when the client left, is made and aborted, and the
    engine reports it (the add used to be dropped with the cancel, and the request went
    unreported: missing from /perf_metrics, or pending in the collector for good)."""
    records: list[RequestTimings] = []
    worker = DecodeWorker("d0", tiny_engine(64), None, records.extend)

    async def main() -> None:
        gate = threading.Event()
        worker.loop.call(lambda e: gate.wait(30))  # the engine thread busy: the add queues
        stream = worker.generate(GenerateRequest("q", list(range(1, 11)), greedy(8), time.time()))
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.2)  # (the add is queued)
        first.cancel()  # the client leaves
        with pytest.raises(asyncio.CancelledError):
            await first
        abort = asyncio.ensure_future(worker.abort("q", prompt_tokens=10))  # the router's
        await asyncio.sleep(0.2)  # (the call had arrived: the usual abort, queued too)
        gate.set()
        await abort
        deadline = time.monotonic() + 10
        while not any(r.request_id == "q" for r in await reports(worker, records)):
            assert time.monotonic() < deadline, "the request was never reported"
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        q = [r for r in await reports(worker, records) if r.request_id == "q"]
        assert [r.finish_reason for r in q] == ["abort"]
        await wait_until_no_page_held(worker)

    try:
        asyncio.run(main())
    finally:
        worker.close()
