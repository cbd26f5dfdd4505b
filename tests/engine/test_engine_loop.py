"""EngineLoop's tick: on the loop thread, after the step, before that step's outputs are delivered;
a failing tick never stops the loop; a failed step fails every call and stream, then tells the
owner; a loop stuck past its stall limit is not alive until it moves again."""

from __future__ import annotations

import concurrent.futures
import threading
import time

from engine.engine_core import LLMEngine
from engine.engine_loop import EngineLoop
from engine.outputs import RequestOutput
from tests.tiny_engine import greedy, tiny_engine


def test_the_tick_sees_a_finished_requests_stats_before_its_consumer_hears_of_it() -> None:
    seen: list[str] = []  # request ids whose stats the tick took, in order
    threads: set[str] = set()
    order: list[tuple[str, list[str]]] = []  # (what the consumer saw, what the tick had taken)
    done = concurrent.futures.Future()

    def tick(engine: LLMEngine) -> None:
        threads.add(threading.current_thread().name)
        seen.extend(r.request_id for r in engine.drain_request_stats())

    def sink(out: RequestOutput) -> None:
        if out.finished:
            order.append((out.request_id, list(seen)))
            done.set_result(None)

    loop = EngineLoop(tiny_engine(32), name="tick-test", on_tick=tick)
    try:
        loop.subscribe("r", sink)
        loop.call(lambda e: e.add_request("r", list(range(1, 9)), greedy(3)))
        done.result(30)
    finally:
        loop.stop()
    assert order == [("r", ["r"])] and threads == {"tick-test"}


def test_a_failing_tick_does_not_stop_the_loop() -> None:
    ticks = []

    def tick(engine: LLMEngine) -> None:
        ticks.append(1)
        raise RuntimeError("stats broke")

    finished: concurrent.futures.Future[RequestOutput] = concurrent.futures.Future()
    loop = EngineLoop(tiny_engine(32), on_tick=tick)
    try:
        loop.subscribe("r", lambda out: out.finished and finished.set_result(out))
        loop.call(lambda e: e.add_request("r", list(range(1, 9)), greedy(3)))
        assert len(finished.result(30).token_ids) == 3 and loop.alive
    finally:
        loop.stop()
    assert len(ticks) >= 3


def test_after_a_failed_step_every_call_fails_with_the_reason() -> None:
    engine = tiny_engine(32)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("device error")

    engine.runner.execute = broken  # type: ignore[method-assign]
    finished: concurrent.futures.Future[RequestOutput] = concurrent.futures.Future()
    fatal: concurrent.futures.Future[str] = concurrent.futures.Future()
    loop = EngineLoop(engine, on_fatal=fatal.set_result)
    try:
        loop.subscribe("r", lambda out: out.finished and finished.set_result(out))
        loop.call(lambda e: e.add_request("r", list(range(1, 9)), greedy(3))).result(30)
        # The requests (and so their clients) are told the kind; the text is in the log: it may
        # carry paths or another request's data.
        told = "engine step failed (RuntimeError); the worker's log has why"
        assert finished.result(30).error == told
        # then the owner hears of it (a worker actor goes down there), after the streams did
        assert fatal.result(30) == "engine step failed: RuntimeError: device error"
        later = loop.call(lambda e: e.kv.free("r"))  # e.g. a worker freeing the request's pages
        try:
            later.result(30)
        except RuntimeError as e:
            assert told in str(e)
        else:
            raise AssertionError("a call after the loop ended ran")
        assert not loop.alive
    finally:
        loop.stop()


def test_a_loop_stuck_past_its_stall_limit_is_not_alive_until_it_moves_again() -> None:
    """A call (or step) that does not return, as on a device that stopped answering: the loop's
    thread still runs, but ``alive`` (the worker's health in its stats) turns False once the
    limit has passed, and True again when the call ends; the loop then serves as before."""
    gate = threading.Event()
    loop = EngineLoop(tiny_engine(32), stall_limit_s=0.2)
    try:
        assert loop.alive
        stuck = loop.call(lambda e: gate.wait(30))
        deadline = time.monotonic() + 10
        while loop.alive:
            assert time.monotonic() < deadline, "a stuck loop still reported alive"
            time.sleep(0.02)
        assert loop.stalled and not stuck.done()
        gate.set()
        assert stuck.result(10) is True
        assert loop.alive and not loop.stalled
        finished: concurrent.futures.Future[RequestOutput] = concurrent.futures.Future()
        loop.subscribe("r", lambda out: out.finished and finished.set_result(out))
        loop.call(lambda e: e.add_request("r", list(range(1, 9)), greedy(3)))
        assert len(finished.result(30).token_ids) == 3
    finally:
        gate.set()
        loop.stop()


def test_stop_gives_back_every_page_requests_still_hold() -> None:
    """A worker closed with requests in flight: one decoding, one prefilled and kept for its
    lease (prefill-only), and pages allocated for a KV receive; after stop every page is back."""
    engine = tiny_engine(32)
    first: concurrent.futures.Future[RequestOutput] = concurrent.futures.Future()
    loop = EngineLoop(engine)
    try:
        loop.subscribe("long", lambda out: first.done() or first.set_result(out))
        loop.call(lambda e: e.add_request("long", list(range(1, 9)), greedy(200))).result(30)
        loop.call(
            lambda e: e.add_request("kept", list(range(20, 30)), greedy(4), prefill_only=True)
        ).result(30)
        loop.call(lambda e: e.kv.allocate_slots("receiving", 8)).result(30)
        first.result(30)
    finally:
        loop.stop()
    assert not engine.kv.request_ids() and not engine.scheduler.requests
    engine.kv.check_integrity()
    assert all(g.used == 0 for g in engine.kv.stats().groups.values())
