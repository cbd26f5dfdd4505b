"""DecodeWorker: one live call per request id. The router retries a decode on the same worker
when Ray reported it unreachable and no other is live; the first call may in fact run on. The
second call waits until the first has let the request's pages go (it used to take them, or have
them freed under it while it ran), and an abort that comes between a failed pull and the
request's local prefill stops it (it used to be lost: the request ran on for nobody)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from decode_worker.worker import DecodeWorker
from tests.decode_worker.worker_helpers import (
    facing_a_stall,
    pull_failed_behind_a_step,
    pull_under_way,
    reports,
    wait_until_no_page_held,
)
from tests.tiny_engine import greedy, tiny_engine
from worker_common.messages import GenerateRequest, RequestTimings


@pytest.mark.timeout(120)
def test_a_second_call_for_an_id_waits_for_the_first_to_let_its_pages_go() -> None:
    records: list[RequestTimings] = []
    worker, stalled = facing_a_stall(records)
    prompt = list(range(1, 23))

    async def main() -> None:
        ref = [
            d async for d in worker.generate(GenerateRequest("ref", prompt, greedy(6), time.time()))
        ]
        want = [t for d in ref for t in d.token_ids]
        await wait_until_no_page_held(worker)
        first = await pull_under_way(worker, stalled, prompt)  # request "x", its pages taken
        await worker.abort("x")  # the router's, before its retry here
        second = [
            d async for d in worker.generate(GenerateRequest("x", prompt, greedy(6), time.time()))
        ]
        await first  # (it ended, aborted, when its pull did: before the second began)
        assert [t for d in second for t in d.token_ids] == want
        assert second[-1].error is None and second[-1].finish_reason == "length"
        await wait_until_no_page_held(worker)  # (and the pool's books agree: check_integrity)
        assert [r.finish_reason for r in await reports(worker, records) if r.request_id == "x"] == [
            "abort",
            "length",
        ]

    try:
        asyncio.run(main())
    finally:
        stalled.close()
        worker.close()


@pytest.mark.timeout(120)
def test_an_abort_between_a_failed_pull_and_the_local_prefill_stops_the_request() -> None:
    records: list[RequestTimings] = []
    worker, stalled = facing_a_stall(records, on_failure="recompute")
    step_ends = threading.Event()

    async def main() -> None:
        task = await pull_under_way(worker, stalled, list(range(1, 23)))
        await pull_failed_behind_a_step(worker, task, step_ends)
        abort = asyncio.ensure_future(worker.abort("x"))  # (no ray.cancel: the call runs on)
        await asyncio.sleep(0.2)
        step_ends.set()
        await asyncio.wait_for(abort, 10)
        await asyncio.wait_for(task, 10)  # no token streamed: it was not prefilled here
        await wait_until_no_page_held(worker)
        assert worker.stats().transfer.recomputed == 0
        ((rid, finish),) = [(r.request_id, r.finish_reason) for r in await reports(worker, records)]
        assert (rid, finish) == ("x", "abort")

    try:
        asyncio.run(main())
    finally:
        step_ends.set()
        stalled.close()
        worker.close()


def test_a_stream_closed_mid_way_frees_its_request_before_the_next_call_of_its_id() -> None:
    """The client's stream closed while the request decodes (Ray closes the call's generator):
    the request's cleanup runs before the call lets the id go, so a next call of the id starts
    clean (the inner stream was left to the loop's finalizer: the next call's add met the old
    request, and the old one's late cleanup then aborted the new one)."""
    worker = DecodeWorker("d0", tiny_engine(64), None)
    prompt = list(range(1, 11))

    async def main() -> None:
        ref = [d async for d in worker.generate(GenerateRequest("ref", prompt, greedy(6), 0.0))]
        stream = worker.generate(GenerateRequest("a", prompt, greedy(100), time.time()))
        assert (await stream.__anext__()).token_ids
        await stream.aclose()
        again = [d async for d in worker.generate(GenerateRequest("a", prompt, greedy(6), 0.0))]
        assert [t for d in again for t in d.token_ids] == [t for d in ref for t in d.token_ids]
        assert again[-1].error is None and again[-1].finish_reason == "length"
        await wait_until_no_page_held(worker)

    try:
        asyncio.run(main())
    finally:
        worker.close()
