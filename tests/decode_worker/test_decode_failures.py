"""DecodeWorker with a real engine and transceiver: a transfer that fails, stalls or loses its
client, and the decode section's deadlines, each end the request cleanly, report it, and give
every page back."""

from __future__ import annotations

import asyncio
import time

import pytest

from decode_worker.worker import DecodeWorker
from tests.decode_worker.worker_helpers import (
    STALL_PULL_DEADLINE_S,
    deadlines_of,
    facing_a_stall,
    pull_failed_behind_a_step,
    pull_under_way,
    reports,
    wait_until_no_page_held,
)
from tests.tiny_engine import PAGE, greedy, tiny_engine
from transfer import KVReceiver, TransceiverConfig
from worker_common.messages import GenerateRequest, PrefillResult, RequestTimings


def test_a_failed_transfer_frees_the_pages_and_counts_once(caplog) -> None:
    # Two ways a transfer fails: the pull fails (P ended the lease first), or it cannot run (the
    # receiver closed while requests still came). Either ends in an error delta with D's pages
    # back, and the Prometheus counter gets one per failed pull (it got two before).
    import types

    from cluster.frontend import ClusterFrontend
    from cluster.prom_metrics import ServingMetrics
    from cluster.worker_choice import WorkerSlot
    from prefill_worker.worker import PrefillWorker
    from transfer import KVSender

    cfg = TransceiverConfig(secret="test-secret", lease_s=5.0)
    pe, de = tiny_engine(64), tiny_engine(64)
    specs = list(pe.kv.specs.values())
    prefill = PrefillWorker("p0", pe, lambda rel: KVSender(pe.kv.buffers, specs, "tiny", cfg, rel))
    receiver = KVReceiver(de.kv.buffers, list(de.kv.specs.values()), "tiny", cfg)
    worker = DecodeWorker("d0", de, receiver)

    async def decode(rid: str, before_pull) -> list:
        req = GenerateRequest(rid, list(range(1, 11)), greedy(4), time.time())
        pre = await prefill.prefill(req)
        await before_pull(rid)
        out = [d async for d in worker.decode(req, pre)]
        await wait_until_no_page_held(worker)
        return out

    async def main() -> None:
        (failed,) = await decode("gone", prefill.cancel)  # the lease ended before the pull
        assert failed.finish_reason == "abort" and "KV transfer failed" in failed.error
        metrics = ServingMetrics("tiny")
        stats = worker.stats()
        ClusterFrontend._export_worker(
            types.SimpleNamespace(metrics=metrics), WorkerSlot("d0", None, last_stats=stats)
        )
        exported = metrics.render().decode()
        assert (
            'kv_transfer_failures_total{model_name="tiny",role="decode",worker="d0"} 1.0'
            in exported
        )

        # A prefill worker that cannot be reached: the client is not told its address.
        import dataclasses
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            closed_port = s.getsockname()[1]
        req = GenerateRequest("unreachable", list(range(1, 11)), greedy(4), time.time())
        pre = await prefill.prefill(req)
        pre = dataclasses.replace(pre, ticket=dataclasses.replace(pre.ticket, port=closed_port))
        (failed,) = [d async for d in worker.decode(req, pre)]
        assert (
            failed.error.startswith("KV transfer failed") and str(closed_port) not in failed.error
        )
        assert f"cannot connect to 127.0.0.1:{closed_port}" in caplog.text
        await prefill.cancel("unreachable")
        await wait_until_no_page_held(worker)

        async def close_receiver(_rid: str) -> None:
            receiver.close()

        (failed,) = await decode("closed", close_receiver)  # the pull cannot even start
        assert "KV transfer failed" in failed.error and "KVReceiver is closed" in caplog.text
        assert worker.stats().transfer.failures == 3  # (what the export counts, once each)

    try:
        asyncio.run(main())
    finally:
        worker.close()
        prefill.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("on_failure", ["fail", "recompute"])
def test_a_fill_stall_ends_at_the_pull_deadline_and_frees_the_pages(
    on_failure: str, caplog
) -> None:
    """Pages that never land: the pull ends at its deadline with a clear error, every page the
    request held on D is free again, and with ``recompute`` the request completes all the same,
    with the tokens a local prefill gives."""
    records: list[RequestTimings] = []
    worker, stalled = facing_a_stall(records, on_failure)
    prompt = list(range(1, 23))

    async def main() -> None:
        ref = [
            d async for d in worker.generate(GenerateRequest("ref", prompt, greedy(6), time.time()))
        ]
        want = [t for d in ref for t in d.token_ids]
        assert ref[0].num_cached_tokens == 0  # (prefilled here: a prompt first seen)
        await wait_until_no_page_held(worker)
        req = GenerateRequest("x", prompt, greedy(6), time.time())
        pre = PrefillResult("x", want[0], "", None, ticket=stalled.ticket("x", len(prompt)))
        started = time.monotonic()
        out = [d async for d in worker.decode(req, pre)]
        assert time.monotonic() - started >= STALL_PULL_DEADLINE_S
        totals = worker.stats().transfer
        assert totals.failures == 1
        if on_failure == "fail":
            (failed,) = out
            assert failed.finish_reason == "abort"
            # The client hears that the transfer failed; the worker's log says why.
            assert failed.error.startswith("KV transfer failed") and "127.0.0.1" not in failed.error
            assert "timed out after 1.0s waiting for the first chunk" in caplog.text
            assert totals.failed_requests == 1 and totals.recomputed == 0
        else:
            assert all(d.error is None for d in out) and out[-1].finish_reason == "length"
            assert [want[0]] + [t for d in out for t in d.token_ids] == want
            # The prompt computed here says its own prefix hit ("ref"'s 5 full pages), after
            # P's: the client's usage counts the latest.
            assert [d.num_cached_tokens for d in out] == [5 * PAGE] + [None] * (len(out) - 1)
            assert totals.recomputed == 1 and totals.failed_requests == 0
        await wait_until_no_page_held(worker)
        (record,) = [r for r in await reports(worker, records) if r.request_id == "x"]
        assert record.finish_reason == ("error" if on_failure == "fail" else "length")
        assert record.transfer_start is not None and record.transfer_bytes == 0

    try:
        asyncio.run(main())
    finally:
        stalled.close()
        worker.close()


@pytest.mark.timeout(120)
def test_a_client_that_leaves_mid_pull_is_reported_and_its_pages_come_back() -> None:
    """The client goes away while its KV is on the way: the request never reaches the engine,
    yet the worker reports it (an abort, with its transfer's start), and the pages it held for
    the pull come back once the pull has ended (here at its deadline)."""
    records: list[RequestTimings] = []
    worker, stalled = facing_a_stall(records)
    prompt = list(range(1, 23))

    async def main() -> None:
        task = await pull_under_way(worker, stalled, prompt)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        (record,) = await reports(worker, records)
        assert (record.request_id, record.finish_reason) == ("x", "abort")
        assert record.transfer_start is not None and record.output_tokens == 0
        await wait_until_no_page_held(worker)

    try:
        asyncio.run(main())
    finally:
        stalled.close()
        worker.close()


@pytest.mark.timeout(120)
def test_a_pull_its_clients_abort_cut_short_is_no_transfer_failure() -> None:
    """The router's abort while the KV is on the way (it also ends P's lease, so the pull fails):
    the request ends as aborted, and /metrics' transfer failures do not count it."""
    records: list[RequestTimings] = []
    worker, stalled = facing_a_stall(records)

    async def main() -> None:
        task = await pull_under_way(worker, stalled, list(range(1, 23)))
        await worker.abort("x", prompt_tokens=22)  # (its call arrived: the flag is set)
        await task  # the pull fails at its deadline: the request ends, aborted
        (record,) = await reports(worker, records)
        assert (record.request_id, record.finish_reason) == ("x", "abort")
        assert worker.stats().transfer.failures == 0
        await wait_until_no_page_held(worker)

    try:
        asyncio.run(main())
    finally:
        stalled.close()
        worker.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("on_failure", ["fail", "recompute"])
def test_a_client_that_leaves_while_a_failed_pulls_pages_are_freed_leaves_none_held(
    on_failure: str,
) -> None:
    """The pull failed, and its pages' free waits behind a long engine step when the client
    leaves: the free still runs once the step ends (the cancel used to cancel the queued free,
    and the pages stayed held for good), and the request is reported as aborted."""
    import threading

    records: list[RequestTimings] = []
    worker, stalled = facing_a_stall(records, on_failure)
    step_ends = threading.Event()
    prompt = list(range(1, 23))

    async def main() -> None:
        task = await pull_under_way(worker, stalled, prompt)
        await pull_failed_behind_a_step(worker, task, step_ends)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        step_ends.set()
        await wait_until_no_page_held(worker)
        (record,) = await reports(worker, records)
        assert (record.request_id, record.finish_reason) == ("x", "abort")
        assert worker.stats().transfer.failures == 1  # (counted before the free)

    try:
        asyncio.run(main())
    finally:
        step_ends.set()
        stalled.close()
        worker.close()


@pytest.mark.timeout(120)
def test_waiting_for_pages_ends_at_decode_page_wait_deadline_s() -> None:
    engine = tiny_engine(8)
    receiver = KVReceiver(
        engine.kv.buffers,
        list(engine.kv.specs.values()),
        "tiny",
        TransceiverConfig(secret="test-secret"),
    )
    records: list[RequestTimings] = []
    worker = DecodeWorker(
        "d0", engine, receiver, records.extend, deadlines=deadlines_of(page_wait_deadline_s=0.5)
    )

    async def main() -> None:
        assert await asyncio.wrap_future(
            worker.loop.call(lambda e: e.kv.allocate_slots("hog", 7 * PAGE))
        )
        req = GenerateRequest("x", list(range(1, 13)), greedy(4), time.time())
        # (the client is told which setting ended it: it was a RuntimeError, which the router
        # could only call a failed worker)
        (failed,) = [d async for d in worker.decode(req, PrefillResult("x", 5, "", None, None))]
        assert failed.error == "no free KV pages within 0.5s (decode.page_wait_deadline_s)"
        await asyncio.wrap_future(worker.loop.call(lambda e: e.kv.free("hog")))
        await wait_until_no_page_held(worker)
        assert [(r.request_id, r.finish_reason) for r in await reports(worker, records)] == [
            ("x", "error")
        ]

    try:
        asyncio.run(main())
    finally:
        worker.close()


@pytest.mark.parametrize("on_failure", ["fail", "recompute"])
def test_a_lease_that_ends_while_d_waits_for_pages_ends_the_wait(
    on_failure: str, caplog: pytest.LogCaptureFixture
) -> None:
    """P's lease ends while D waits for free pages (decode.page_wait_deadline_s longer than
    transfer.lease_s, as by default): D stops waiting then, no pull (P would refuse it,
    expired). ``fail``: the request ends with the transfer's error at the lease's end, not the
    page wait's (D got its pages, pulled, and was refused); ``recompute``: it is prefilled here
    once pages are free, with a local prefill's tokens."""
    from prefill_worker.worker import PrefillWorker
    from transfer import KVSender

    cfg = TransceiverConfig(secret="test-secret", lease_s=1.0)
    pe, de = tiny_engine(64), tiny_engine(8)
    specs = list(pe.kv.specs.values())
    prefill = PrefillWorker("p0", pe, lambda rel: KVSender(pe.kv.buffers, specs, "tiny", cfg, rel))
    receiver = KVReceiver(de.kv.buffers, list(de.kv.specs.values()), "tiny", cfg)
    worker = DecodeWorker(
        "d0", de, receiver, on_failure=on_failure, deadlines=deadlines_of(page_wait_deadline_s=30)
    )
    prompt = list(range(1, 13))

    async def main() -> None:
        ref = [d async for d in worker.generate(GenerateRequest("r", prompt, greedy(4), 0.0))]
        want = [t for d in ref for t in d.token_ids]
        await wait_until_no_page_held(worker)
        hog = worker.loop.call(lambda e: e.kv.allocate_slots("hog", 7 * PAGE))
        assert await asyncio.wrap_future(hog)
        req = GenerateRequest("x", prompt, greedy(4), time.time())
        pre = await prefill.prefill(req)
        out: list = []

        async def decode() -> None:
            out.extend([d async for d in worker.decode(req, pre)])

        task = asyncio.ensure_future(decode())
        if on_failure == "fail":
            await asyncio.wait_for(task, 20)  # (the page wait would have run 30 s)
            (failed,) = out
            assert failed.error.startswith("KV transfer failed")
        else:
            await asyncio.sleep(2.0)  # (past the lease: the request waits in the scheduler)
            await asyncio.wrap_future(worker.loop.call(lambda e: e.kv.free("hog")))
            await asyncio.wait_for(task, 30)
            assert all(d.error is None for d in out)
            assert [pre.first_token_id] + [t for d in out for t in d.token_ids] == want
            assert worker.stats().transfer.recomputed == 1
        # D stopped waiting when the lease ended, and made no pull (P would have refused it)
        assert "lease on the KV (transfer.lease_s) ended while decode worker d0" in caplog.text
        await asyncio.wrap_future(worker.loop.call(lambda e: e.kv.free("hog")))
        await wait_until_no_page_held(worker)
        await prefill.cancel("x")

    try:
        asyncio.run(main())
    finally:
        worker.close()
        prefill.close()


def test_a_stalled_engine_ends_a_request_at_decode_token_deadline_s() -> None:
    # 1 s, not less: on a loaded 2-core box the first token itself took longer than 0.3 s.
    worker = DecodeWorker("d0", tiny_engine(64), None, deadlines=deadlines_of(token_deadline_s=1.0))

    async def main() -> None:
        stream = worker.generate(GenerateRequest("a", list(range(1, 11)), greedy(200), time.time()))
        first = await stream.__anext__()
        assert first.token_ids and first.error is None
        worker.loop.call(lambda e: time.sleep(3.0))  # the engine stalls: no token for 3 s
        deltas = [d async for d in stream]
        assert deltas[-1].error == "no token within 1.0s (decode.token_deadline_s)"
        await wait_until_no_page_held(worker)

    try:
        asyncio.run(main())
    finally:
        worker.close()
