"""Runs an LLMEngine's step loop on its own thread, for the workers.

The engine is single-threaded by design. Every touch of it from outside (adding, aborting or
releasing a request, allocating pages for an incoming transfer, reading page ids) goes through
``call``, which runs the function on the loop thread between two steps. Outputs of a step are handed
to the sink that ``subscribe`` registered for their request id, on the loop thread; sinks must only
enqueue (for example ``loop.call_soon_threadsafe`` into an asyncio queue).

A loop stuck in one step or call (a device that stopped answering, a collective a rank never
joins) still answers from other threads: with ``stall_limit_s``, ``alive`` turns False while the
current step or call has run longer than that, so the worker's stats report it unhealthy and the
router sends it nothing new; it turns True again if the step ends. A step that fails ends the
loop: every stream and queued call fails with the reason, then ``on_fatal(reason)`` runs (a
worker actor goes down there, and Ray restarts it with a fresh engine).

``on_tick(engine)`` runs on the loop thread after every round of calls and every step, before that
step's outputs are delivered (so whatever it takes from the engine's stats of a finished request is
taken before the request's consumer hears it finished), and at least every ``idle_wait_s`` while
idle: the workers' per-request reports and stats intervals live there.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from engine.engine_core import LLMEngine
from engine.outputs import RequestOutput

log = logging.getLogger(__name__)
T = TypeVar("T")
# From a fatal error's last stream error to ``on_fatal`` (which may end the process).
FATAL_GRACE_S = 1.0
Sink = Callable[[RequestOutput], None]


class EngineLoop:
    """A thread that alternates between queued calls and engine steps."""

    def __init__(
        self,
        engine: LLMEngine,
        name: str = "engine-loop",
        idle_wait_s: float = 0.05,
        on_tick: Callable[[LLMEngine], None] | None = None,
        stall_limit_s: float | None = None,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        self.engine = engine
        self._stall_limit_s = stall_limit_s
        self._on_fatal = on_fatal
        self._busy_since: float | None = None  # monotonic start of the current step or calls
        self._on_tick = on_tick
        self._calls: queue.SimpleQueue[
            tuple[Callable[[LLMEngine], Any], concurrent.futures.Future]
        ] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._sinks_lock = threading.Lock()
        self._stop = threading.Event()
        # Why the loop takes no more calls (None while it does). Set and checked under the lock,
        # so a call is either queued before the loop's last drain or refused: never left waiting.
        self._closed: str | None = None
        self._closed_lock = threading.Lock()
        self._idle_wait_s = idle_wait_s
        self.fatal_error: str | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- API (any thread) ----
    def call(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future[T]:
        """Run ``fn(engine)`` on the loop thread; the future carries its result or exception. Once
        the loop has ended (stopped, or a step failed), it fails at once with the reason."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._closed_lock:
            closed = self._closed or ("the engine loop is stopped" if self._stop.is_set() else None)
            if closed is None:
                self._calls.put((fn, fut))
                return fut
        fut.set_exception(RuntimeError(closed))
        return fut

    def abort(
        self, request_id: str, reason: str, keep_prefilled: bool = False
    ) -> concurrent.futures.Future[bool]:
        """Abort ``request_id`` in the engine and end its subscriber's stream with ``reason``: an
        aborted request makes no output of its own, so a consumer waiting for one would wait
        until its deadline. The future tells whether it was aborted (``keep_prefilled``: not a
        request already prefilled, whose output went out; see LLMEngine.abort_request)."""

        def run(engine: LLMEngine) -> bool:
            aborted = engine.abort_request(request_id, keep_prefilled)
            if aborted:
                with self._sinks_lock:
                    sink = self._sinks.pop(request_id, None)
                if sink is not None:
                    sink(_error_output(request_id, reason))
            return aborted

        return self.call(run)

    def subscribe(self, request_id: str, sink: Sink) -> None:
        with self._sinks_lock:
            self._sinks[request_id] = sink

    def unsubscribe(self, request_id: str) -> None:
        with self._sinks_lock:
            self._sinks.pop(request_id, None)

    @property
    def alive(self) -> bool:
        """The loop runs, no step failed, and none has run past ``stall_limit_s``."""
        return self._thread.is_alive() and self.fatal_error is None and not self.stalled

    @property
    def stalled(self) -> bool:
        """Whether the current step or call has run longer than ``stall_limit_s``."""
        since = self._busy_since  # (one read: the loop thread clears it)
        limit = self._stall_limit_s
        return limit is not None and since is not None and time.monotonic() - since > limit

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the loop (every live stream and later call fails), then, once its thread has
        ended, give back every page a request still holds and close the engine."""
        self._stop.set()
        self._calls.put((lambda e: None, concurrent.futures.Future()))  # wake the thread
        self._thread.join(timeout_s)
        if not self._thread.is_alive():  # no step in flight: the other TP ranks may stop too
            try:
                self._free_all()
            except Exception:  # (after a failed step the engine may be past freeing: close it)
                log.exception("freeing the pages of a stopped engine failed")
            self.engine.close()

    # ---- the loop thread ----
    def _run(self) -> None:
        try:
            self._steps()
        except Exception as e:  # outside a step (setting the device, a tick's own failure path)
            log.exception("engine loop failed")
            self._fail("engine loop failed", e)
        if self.fatal_error is not None and self._on_fatal is not None:
            # (after every stream has its error: give their consumers a moment to send it)
            time.sleep(FATAL_GRACE_S)
            self._on_fatal(self.fatal_error)

    def _steps(self) -> None:
        engine = self.engine
        device = engine.kv.device
        if device.type == "cuda" and device.index is not None:
            # The current device is per thread, and Triton launches on it: with several GPUs
            # visible (cluster workers that use CUDA IPC), this thread must name ours.
            torch.cuda.set_device(device)
        while not self._stop.is_set():
            busy = engine.has_unfinished()
            self._run_calls(block=not busy)
            if self._stop.is_set():
                break
            if not engine.has_unfinished():
                self._tick()
                continue
            self._busy_since = time.monotonic()
            try:
                outputs = engine.step()
            except Exception as e:  # a bug in a step: fail every live request, keep no one waiting
                log.exception("engine step failed")
                self._fail("engine step failed", e)
                return
            finally:
                self._busy_since = None
            self._tick()
            self._deliver(outputs)
        self._fail_all("the engine loop stopped")

    def _run_calls(self, block: bool) -> None:
        try:
            item = self._calls.get(timeout=self._idle_wait_s) if block else self._calls.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                self._busy_since = time.monotonic()
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as e:  # handed to the caller
                    fut.set_exception(e)
                finally:
                    self._busy_since = None
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return

    def _tick(self) -> None:
        if self._on_tick is None:
            return
        try:
            self._on_tick(self.engine)
        except Exception:  # stats are an aid: never a reason to stop serving
            log.exception("engine loop tick failed")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._sinks_lock:
                sink = self._sinks.get(out.request_id)
                if out.finished:
                    self._sinks.pop(out.request_id, None)
            if sink is None:
                continue  # nobody listens any more (client gone): the request still ran to its end
            try:
                sink(out)
            except Exception:
                log.exception("output sink of %s failed", out.request_id)

    def _free_all(self) -> None:
        """The engine's requests aborted and any other page holder (pages allocated for a KV
        receive) freed: a stopped worker's pages do not outlive it (its KV accounting stays
        exact, as the leak checks read it). Only once the loop thread has ended."""
        engine = self.engine
        for request_id in list(engine.scheduler.requests):
            engine.abort_request(request_id)
        for request_id in engine.kv.request_ids():
            engine.kv.free(request_id)

    def _fail(self, what: str, e: Exception) -> None:
        """The loop ends on ``e``: ``fatal_error`` (its owner's, the log's) has its text; the
        requests and calls it fails (and through them clients) are told its kind only, as its
        text may carry paths or another request's data."""
        self.fatal_error = f"{what}: {type(e).__name__}: {e}"
        self._fail_all(f"{what} ({type(e).__name__}); the worker's log has why")

    def _fail_all(self, reason: str) -> None:
        """The loop's end: no more calls, every live request and every queued call fails."""
        with self._closed_lock:
            self._closed = reason
        with self._sinks_lock:
            sinks, self._sinks = self._sinks, {}
        for rid, sink in sinks.items():
            try:
                sink(_error_output(rid, reason))
            except Exception:
                log.exception("output sink of %s failed", rid)
        while True:
            try:
                _, fut = self._calls.get_nowait()
            except queue.Empty:
                break
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError(reason))


def _error_output(request_id: str, reason: str) -> RequestOutput:
    from engine.request import RequestMetrics

    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[],
        text="",
        token_ids=[],
        delta_text="",
        delta_token_ids=[],
        finished=True,
        finish_reason=None,
        stop_reason=None,
        metrics=RequestMetrics(arrival_time=0.0),
        error=reason,
    )
