"""DecodeWorker (the plain class) with a real engine on random weights: a client that goes away never
leaves pages held, whether it leaves mid-stream or while its request still waits for pages."""

from __future__ import annotations

import asyncio
import time

import pytest

from decode_worker.worker import DecodeWorker
from tests.tiny_engine import PAGE, greedy, tiny_engine
from transfer import KVReceiver, TransceiverConfig
from worker_common.messages import (
    GenerateRequest,
    PrefillResult,
    RequestTimings,
    TokenDelta,
    WorkerDeadlines,
)


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
    engine = tiny_engine(8)  # 7 usable pages of 4 tokens
    receiver = KVReceiver(
        engine.kv.buffers,
        list(engine.kv.specs.values()),
        "tiny",
        TransceiverConfig(secret="test-secret"),
    )
    records: list[RequestTimings] = []
    worker = DecodeWorker(
        "d0", engine, receiver, report=records.extend, deadlines=WorkerDeadlines(page_wait_s=30)
    )

    async def main() -> None:
        assert await asyncio.wrap_future(
            worker.loop.call(lambda e: e.kv.allocate_slots("hog", 7 * PAGE))
        )
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


def test_a_failed_transfer_frees_the_pages_and_counts_once() -> None:
    # Two ways a transfer fails: the pull fails (P ended the lease first), or it cannot run (the
    # receiver closed while requests still came). Either ends in an error delta with D's pages
    # back, and the Prometheus counter gets one per failed pull (it got two before).
    import types

    from cluster.frontend import ClusterFrontend
    from cluster.prom_metrics import ServingMetrics
    from cluster.router import WorkerSlot
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

        async def close_receiver(_rid: str) -> None:
            receiver.close()

        (failed,) = await decode("closed", close_receiver)  # the pull cannot even start
        assert "KVReceiver is closed" in failed.error
        assert worker.stats().transfer.failures == 2  # (what the export counts, once each)

    try:
        asyncio.run(main())
    finally:
        worker.close()
        prefill.close()


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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("on_failure", ["fail", "recompute"])
def test_a_fill_stall_ends_at_the_pull_deadline_and_frees_the_pages(on_failure: str) -> None:
    """Pages that never land: the pull ends at its deadline with a clear error, every page the
    request held on D is free again, and with ``recompute`` the request completes all the same,
    with the tokens a local prefill gives."""
    engine = tiny_engine(64)
    cfg = TransceiverConfig(
        secret="test-secret", direct_copy=False, pull_deadline_s=1.0, chunk_deadline_s=0.5
    )
    receiver = KVReceiver(engine.kv.buffers, list(engine.kv.specs.values()), "tiny", cfg)
    records: list[RequestTimings] = []
    worker = DecodeWorker("d0", engine, receiver, records.extend, on_failure=on_failure)
    stalled = StalledPrefill(engine, receiver.runtime.worker_address)
    prompt = list(range(1, 23))

    async def main() -> None:
        ref = [
            d async for d in worker.generate(GenerateRequest("ref", prompt, greedy(6), time.time()))
        ]
        want = [t for d in ref for t in d.token_ids]
        await wait_until_no_page_held(worker)
        req = GenerateRequest("x", prompt, greedy(6), time.time())
        pre = PrefillResult("x", want[0], "", None, ticket=stalled.ticket("x", len(prompt)))
        started = time.monotonic()
        out = [d async for d in worker.decode(req, pre)]
        assert time.monotonic() - started >= cfg.pull_deadline_s
        totals = worker.stats().transfer
        assert totals.failures == 1
        if on_failure == "fail":
            (failed,) = out
            assert failed.finish_reason == "abort"
            assert (
                "KV transfer failed: timed out after 1.0s waiting for the first chunk"
                in failed.error
            )
            assert totals.failed_requests == 1 and totals.recomputed == 0
        else:
            assert all(d.error is None for d in out) and out[-1].finish_reason == "length"
            assert [want[0]] + [t for d in out for t in d.token_ids] == want
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
    engine = tiny_engine(64)
    cfg = TransceiverConfig(
        secret="test-secret", direct_copy=False, pull_deadline_s=1.0, chunk_deadline_s=0.5
    )
    receiver = KVReceiver(engine.kv.buffers, list(engine.kv.specs.values()), "tiny", cfg)
    records: list[RequestTimings] = []
    worker = DecodeWorker("d0", engine, receiver, records.extend)
    stalled = StalledPrefill(engine, receiver.runtime.worker_address)
    prompt = list(range(1, 23))

    async def main() -> None:
        req = GenerateRequest("x", prompt, greedy(6), time.time())
        pre = PrefillResult("x", 5, "", None, ticket=stalled.ticket("x", len(prompt)))

        async def consume() -> None:
            async for _ in worker.decode(req, pre):
                pass

        task = asyncio.ensure_future(consume())
        deadline = time.monotonic() + 10
        while not worker.stats().num_in_flight:  # the pull is under way
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.02)
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


def deadlines_of(**decode: float) -> WorkerDeadlines:
    """The deadlines a decode worker of a cluster config with these ``decode`` settings gets."""
    from cluster.config import config_from_dict
    from cluster.worker_specs import worker_spec
    from worker_common.messages import Role

    return worker_spec(
        config_from_dict({"decode": decode}), Role.DECODE, 0, None, transfer_secret="x"
    ).deadlines


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
        with pytest.raises(RuntimeError, match=r"within 0.5s \(decode.page_wait_deadline_s\)"):
            async for _ in worker.decode(req, PrefillResult("x", 5, "", None, ticket=None)):
                pass
        await asyncio.wrap_future(worker.loop.call(lambda e: e.kv.free("hog")))
        await wait_until_no_page_held(worker)
        assert [(r.request_id, r.finish_reason) for r in await reports(worker, records)] == [
            ("x", "error")
        ]

    try:
        asyncio.run(main())
    finally:
        worker.close()


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


@pytest.mark.timeout(120)
def test_a_hybrid_request_pulls_per_group_what_d_lacks() -> None:
    """A tiny Gemma 3 prefilled on P in chunks across window boundaries: D allocates only the last
    window's pages of its window group and pulls per group, first all the prompt's pages it lacks,
    then, for a prompt sharing a prefix with the first, only those past its own prefix hit; the
    tokens equal D's own local prefill of the same prompts."""
    from prefill_worker.worker import PrefillWorker
    from tests.tiny_engine import tiny_hybrid_engine
    from transfer import KVSender

    cfg = TransceiverConfig(secret="test-secret")
    pe, de = tiny_hybrid_engine(64), tiny_hybrid_engine(64)
    assert sorted(pe.kv.specs) == ["full", "swa_32"]
    specs = list(pe.kv.specs.values())
    prefill = PrefillWorker("p0", pe, lambda rel: KVSender(pe.kv.buffers, specs, "tiny", cfg, rel))
    receiver = KVReceiver(de.kv.buffers, list(de.kv.specs.values()), "tiny", cfg)
    worker = DecodeWorker("d0", de, receiver)
    shared = [(7 * i) % 200 + 5 for i in range(64)]
    # 66 and 73 tokens. D's window group holds the first from page (66 - 31) // 4 = 8 on, all a hit
    # at 64 needs ((64 - 31) // 4 = 8): a first prompt of 68 tokens or more would leave D no hit.
    first, second = shared + [9, 8], shared + [11] * 9

    async def decoded(
        rid: str, prompt: list[int], p_window_from: int
    ) -> tuple[list[int], dict[str, int]]:
        req = GenerateRequest(rid, prompt, greedy(6), time.time())
        pre = await prefill.prefill(req)
        assert pre.ticket is not None
        assert pre.ticket.first_page == {"full": 0, "swa_32": p_window_from}
        out = [d async for d in worker.decode(req, pre)]
        assert out[-1].finish_reason == "length" and not out[-1].error
        pages = receiver.stats()["last_transfer"]["pages"]
        return [pre.first_token_id] + [t for d in out for t in d.token_ids], pages

    async def local(rid: str, prompt: list[int]) -> list[int]:
        req = GenerateRequest(rid, prompt, greedy(6), time.time())
        return [t async for d in worker.generate(req) for t in d.token_ids]

    async def main() -> None:
        # P's last chunk started at token 48 (chunks of 24): its window from page (48-31)//4 = 4.
        tokens, pages = await decoded("a", first, 4)
        # 17 prompt pages; the window group's from page 8 on, where D's first step reads.
        assert pages == {"full": 17, "swa_32": 9}
        # D kept the first prompt's pages: the shared 64 tokens (16 pages) hit in both groups.
        # (P's own hit: its only chunk starts at 64, its window from page (64-31)//4 = 8.)
        tokens2, pages2 = await decoded("b", second, 8)
        assert pages2 == {"full": 3, "swa_32": 3}
        await wait_until_no_page_held(worker)
        assert tokens == await local("a-local", first)
        assert tokens2 == await local("b-local", second)
        await wait_until_no_page_held(worker)

    try:
        asyncio.run(main())
    finally:
        worker.close()
        prefill.close()


@pytest.mark.timeout(120)
def test_the_decode_workers_own_prefix_hit_comes_from_its_host_tier() -> None:
    """D pulls only what it does not hold: pages of an earlier turn that its device pool evicted
    are loaded back from its host tier, and the tokens are those of one engine doing it all."""
    cfg = TransceiverConfig(secret="test-secret", lease_s=30.0)
    pe, de = tiny_engine(64), tiny_engine(16, host_pages=32)  # D: 15 device pages of 4 tokens
    assert de.kv.host_tier is not None and de.kv.host_tier.pools["full"].num_pages == 32
    from prefill_worker.worker import PrefillWorker
    from transfer import KVSender

    specs = list(pe.kv.specs.values())
    prefill = PrefillWorker("p0", pe, lambda rel: KVSender(pe.kv.buffers, specs, "tiny", cfg, rel))
    receiver = KVReceiver(de.kv.buffers, list(de.kv.specs.values()), "tiny", cfg)
    worker = DecodeWorker("d0", de, receiver)
    first = list(range(1, 25))  # 6 pages
    second = first + list(range(30, 38))  # 8 pages: D holds the first 6 (on host by then)

    async def disaggregated(rid: str, prompt: list[int]) -> list[int]:
        req = GenerateRequest(rid, prompt, greedy(3), time.time())
        pre = await prefill.prefill(req)
        tokens = [pre.first_token_id]
        async for d in worker.decode(req, pre):
            tokens += d.token_ids
        return tokens

    async def main() -> list[list[int]]:
        out = [await disaggregated("a", first)]
        for i in range(3):  # other prompts push "a"'s pages out of D's device pool
            await disaggregated(f"other-{i}", list(range(40 + 30 * i, 64 + 30 * i)))
        stats = await asyncio.wrap_future(worker.loop.call(lambda e: e.kv.stats()))
        assert stats.groups["full"].host.offloaded >= 6  # type: ignore[union-attr]
        out.append(await disaggregated("b", second))
        await wait_until_no_page_held(worker)
        return out

    try:
        answers = asyncio.run(main())
        host = de.kv.stats().groups["full"].host
        assert host is not None and host.loaded_back >= 1 and host.hit_tokens >= PAGE
        (b,) = [r.metrics for r in de.drain_request_stats() if r.request_id == "b"]
        assert (
            b.num_cached_tokens >= 4 * PAGE and 0 < b.num_cached_host_tokens <= b.num_cached_tokens
        )
        alone = tiny_engine(64)  # the same weights (seeded): one engine doing all of it
        for rid, prompt, got in (("a", first, answers[0]), ("b", second, answers[1])):
            alone.add_request(rid, prompt, greedy(3))
            final = None
            while alone.has_unfinished():
                final = next((o for o in alone.step() if o.finished), final)
            assert final is not None and got == final.token_ids, rid
    finally:
        worker.close()
        prefill.close()
