"""The router: the P/D state machine behind the HTTP server (it implements server.ServingBackend).

For each request: pick a prefill worker, get the first token and a transfer ticket, stream the
first token, pick a decode worker and stream the rest from it. Which workers, by
``router.policy`` (load_balance, round_robin, prefix_aware, kv_aware: Dynamo's KV router, by
what each worker has cached), is cluster/worker_choice.py's.

Conditional disaggregation (``local_prefill_max_tokens`` > 0, llm-d's threshold): when the decode
worker picked for a request already holds all but at most that many of its prompt tokens, it
prefills the rest itself (its local path) and the request skips the prefill worker and the KV
transfer. A failed prefill is retried on
another prefill worker (``router.prefill_retries``); with no healthy prefill worker the decode worker
prefills locally. Each attempt is numbered (``GenerateRequest.prefill_attempt``) so that the
perf-metrics collector joins D's report with the attempt D took over; a request the router ends
without a decode worker is closed with the collector (``close_request``), since a failed
prefill's report alone cannot say whether another attempt follows. A client that goes away
cancels the request on both sides, and so does
``server.request_timeout_s`` (``call_timeout_s`` here): no request runs longer than that from its
arrival at the router.

Worker health and load (``WorkerSlot.healthy``, ``free_pages``, ``last_stats``) are kept up to date
by the server's stats poller (cluster/stats_poller.py) and by the outcome of each call.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import ray
from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

from cluster.kv_index import KVIndex
from cluster.messages import RequestClosed
from cluster.worker_choice import NoLiveDecodeWorker, WorkerChoice, WorkerSlot, note_unavailable
from worker_common.messages import GenerateRequest, PrefillResult, TokenDelta

log = logging.getLogger(__name__)

# Before a decode worker that was unavailable is tried again (or another one): a restarting
# actor is not back at once. Without this much time left, the request fails instead.
DECODE_RETRY_PAUSE_S = 0.5
# How long a prefill worker's cancel waits for the decode worker to take the abort of the same
# request (``Router._after``): the pages are given back at the latest then.
ABORT_ORDER_WAIT_S = 5.0


def _error_delta(req: GenerateRequest, error: str) -> TokenDelta:
    """The last delta of a request that failed on our side (the server answers 5xx)."""
    return TokenDelta(req.request_id, [], "", "abort", len(req.prompt_token_ids), 0, error=error)


def _worker_failed(req: GenerateRequest, worker_id: str, e: Exception) -> TokenDelta:
    """The last delta of a request whose decode worker failed: the reason in the log, the client
    told its kind and where to look. (Ray's error text carries the node's address, pids, actor
    ids, the remote traceback: not for clients.)"""
    log.warning("request %s: decode worker %s failed: %s", req.request_id, worker_id, e)
    return _error_delta(
        req,
        f"decode worker {worker_id} failed ({type(e).__name__}); the server's log has why, "
        f"under request {req.request_id}",
    )


def _timeout_delta(req: GenerateRequest, call_timeout_s: float) -> TokenDelta:
    delta = _error_delta(
        req, f"the request took longer than server.request_timeout_s ({call_timeout_s:g}s)"
    )
    return dataclasses.replace(delta, timed_out=True)


class Router:
    def __init__(
        self,
        prefill: list[WorkerSlot],
        decode: list[WorkerSlot],
        *,
        policy: str = "load_balance",
        prefill_retries: int = 1,
        local_prefill_fallback: bool = True,
        page_size: int = 16,
        call_timeout_s: float = 300.0,
        kv_index: KVIndex | None = None,
        local_prefill_max_tokens: int = 0,
    ) -> None:
        if not decode:
            raise ValueError("the router needs at least one decode worker")
        # Told of a request the router ends without a decode worker after prefill attempts (the
        # collector's join: no decode report will come; ``RequestClosed``).
        self.close_request: Callable[[RequestClosed], None] | None = None
        self.choice = WorkerChoice(
            prefill, decode, policy, page_size, kv_index, local_prefill_max_tokens
        )
        self.prefill = prefill
        self.decode = decode
        self.prefill_retries = prefill_retries
        self.local_prefill_fallback = local_prefill_fallback
        self.call_timeout_s = call_timeout_s
        self.num_prefill_retries = 0
        self.num_local_fallbacks = 0
        self.num_local_prefills = 0  # requests prefilled on their decode worker by the threshold
        self._ordering: set[asyncio.Task[None]] = set()  # (``_after``'s tasks, kept until done)

    # ---- the request ----
    def _left_s(self, req: GenerateRequest) -> float:
        """Time left of the request's ``call_timeout_s`` from its arrival."""
        return req.arrival_time + self.call_timeout_s - time.time()

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        hashes = self.choice.block_hashes(req)
        try:
            self.choice.live_decode()  # (first: a prefill for no decode worker is lost work)
            local = self.choice.local_prefill_worker(req, hashes)
            prefer = None if self.prefill else self.choice.pick_aggregated(req, hashes)
        except NoLiveDecodeWorker as e:
            yield _error_delta(req, str(e))  # (no worker saw it: nothing to close)
            return
        if local is not None:
            self.num_local_prefills += 1
            async for delta in self._stream_decode(req, None, None, prefer=local):
                yield delta
            return
        if prefer is not None:  # aggregated
            # Its prompt is queued there until its first token (kv_aware weighs it, as for P).
            queued = self.choice.tokens_to_compute(prefer, req, hashes)
            prefer.queued_prefill_tokens += queued
            claimed = hashes  # (its prefix is being computed there, until the first token)
            self.choice.claim(prefer, claimed)
            try:
                async for delta in self._stream_decode(req, None, None, prefer=prefer):
                    prefer.queued_prefill_tokens -= queued
                    self.choice.release(prefer, claimed)
                    queued, claimed = 0, None
                    yield delta
            finally:
                prefer.queued_prefill_tokens -= queued
                self.choice.release(prefer, claimed)
            return
        pre, pworker, attempts, reported = await self._prefill(req, hashes)
        if pre is None:
            if self._left_s(req) <= 0:  # (no time left for a local prefill either)
                self._closed(req.request_id, reported, "error")
                yield _timeout_delta(req, self.call_timeout_s)
                return
            if self.prefill and not self.local_prefill_fallback:
                self._closed(req.request_id, reported, "error")
                yield _error_delta(
                    req, "no prefill worker could serve the request (local fallback is off)"
                )
                return
            self.num_local_fallbacks += 1
            local = dataclasses.replace(req, prefill_attempt=attempts)  # (that many failed)
            async for d in self._stream_decode(
                local, None, None, last_reported=reported, hashes=hashes
            ):
                yield d
            return
        req = dataclasses.replace(req, prefill_attempt=attempts - 1)  # the one D takes over
        n_prompt = len(req.prompt_token_ids)
        handed_over = pre.finish_reason is not None  # (or it ended on P: nothing to hand over)
        try:
            yield TokenDelta(
                req.request_id,
                [pre.first_token_id],
                pre.first_token_text,
                pre.finish_reason,
                n_prompt,
                1,
                stop_reason=pre.stop_reason,
                logprobs=() if pre.first_token_logprobs is None else (pre.first_token_logprobs,),
                prompt_logprobs=pre.prompt_logprobs,
                num_cached_tokens=pre.num_cached_tokens,
            )
            if handed_over:
                return
            handed_over = True
            async for d in self._stream_decode(
                req, pre, pworker, last_reported=req.prefill_attempt, hashes=hashes
            ):
                yield d
        finally:
            if not handed_over and pworker is not None:
                # The client left at its first token, before any decode worker took it: P's
                # lease would pin the pages until it expires, and P's report is the last one.
                pworker.handle.cancel.remote(req.request_id)
                self._closed(req.request_id, req.prefill_attempt, "abort")

    def _after(self, calls: list[Any], then: Callable[[], Any]) -> None:
        """``then()`` once ``calls`` (actor calls' refs; none: at once) have answered, or failed,
        or ABORT_ORDER_WAIT_S passed; in a task of its own, as the caller may be being cancelled."""
        if not calls:
            then()
            return

        async def wait_then() -> None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(ABORT_ORDER_WAIT_S):
                    await asyncio.gather(*calls, return_exceptions=True)
            then()

        task = asyncio.get_running_loop().create_task(wait_then())
        self._ordering.add(task)
        task.add_done_callback(self._ordering.discard)

    def _closed(
        self, request_id: str, last_reported: int, reason: str, decoded_tokens: int = 0
    ) -> None:
        """Tell the collector the request ended here, without a decode worker's report (after
        ``decoded_tokens`` of a decode worker that died): the report of attempt ``last_reported``
        is the last to come (-1: no worker will report it, nothing is to close)."""
        if last_reported >= 0 and self.close_request is not None:
            try:
                self.close_request(RequestClosed(request_id, last_reported, reason, decoded_tokens))
            except Exception as e:  # metrics are an aid: never a reason to fail the request
                log.warning("could not close %s with the collector: %s", request_id, e)

    async def _prefill(
        self, req: GenerateRequest, hashes: list[int] | None = None
    ) -> tuple[PrefillResult | None, WorkerSlot | None, int, int]:
        """(result, its worker, attempts made, the last attempt whose worker reports it: -1 when
        none does, a worker that died reports nothing); (None, None, ...) when none succeeded."""
        tried: set[str] = set()
        reported = -1
        for attempt in range(1 + self.prefill_retries):
            w = self.choice.pick_prefill(req, tried, hashes)
            if w is None or self._left_s(req) <= 0:
                # (out of time: no worker is to blame, none is marked)
                return None, None, attempt, reported
            if attempt:
                self.num_prefill_retries += 1  # (counted once it is made, not when it is due)
            tried.add(w.worker_id)
            w.outstanding += 1
            w.num_prefills += 1
            queued = self.choice.tokens_to_compute(w, req, hashes)
            w.queued_prefill_tokens += queued
            self.choice.claim(w, hashes)
            try:
                call = w.handle.prefill.remote(dataclasses.replace(req, prefill_attempt=attempt))
                async with asyncio.timeout(max(self._left_s(req), 0.0)):  # (not wait_for: it
                    pre = await call  # may lose a cancel)
                return pre, w, attempt + 1, attempt
            except RayActorError as e:  # (before RayTaskError: a task's may be one too)
                note_unavailable(w, e)  # (until its stats answer again, or for good)
                if isinstance(e, RayTaskError):
                    reported = attempt  # (it answered, so it reports)
                if not isinstance(e, ActorDiedError):
                    # Unavailable, not dead: the call may still run there and lease the KV,
                    # which nobody would pull. Cancelled there, as for a deadline, so the pages
                    # come back when it gets through, not at the lease's expiry.
                    w.handle.cancel.remote(req.request_id)
                log.warning(
                    "prefill worker %s unavailable for %s: %s", w.worker_id, req.request_id, e
                )
            except RayTaskError as e:
                if isinstance(e.cause, ValueError):
                    raise e.cause from None  # the request itself is bad: no retry
                reported = attempt  # (its worker reports how it failed)
                log.warning("prefill of %s failed on %s: %s", req.request_id, w.worker_id, e)
            except asyncio.TimeoutError:
                # The request's time ran out: no worker is to blame (a long prompt, a queue), and
                # no other attempt has time. It is cancelled there, which ends the call (and
                # gives up a lease it made meanwhile). Not ray.cancel: a call cancelled before
                # its request reached the engine would go unreported.
                w.handle.cancel.remote(req.request_id)
                return None, None, attempt + 1, attempt  # (aborted there, it reports)
            except asyncio.CancelledError:
                w.handle.cancel.remote(req.request_id)
                self._closed(req.request_id, attempt, "abort")
                raise
            finally:
                w.outstanding -= 1
                w.queued_prefill_tokens -= queued
                self.choice.release(w, hashes)
            w.failures += 1
        return None, None, 1 + self.prefill_retries, reported

    async def _stream_decode(
        self,
        req: GenerateRequest,
        pre: PrefillResult | None,
        pworker: WorkerSlot | None,
        prefer: WorkerSlot | None = None,
        last_reported: int = -1,
        hashes: list[int] | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """Stream from a decode worker (``prefer`` first, when given). A worker that is unavailable
        before it produced anything (it is restarting, died, or is out of reach) is replaced, within
        ``call_timeout_s``, and told to abort the request; after the first token, its failure ends the request with an error (the
        tokens already sent cannot be recalled). At ``call_timeout_s`` from the request's arrival
        the request is aborted with an error. ``last_reported``: the prefill attempt whose report
        is the collector's last when no decode worker reports the request (-1: none).
        ``hashes``: the prompt's block hashes, for a pick by what each decode worker holds (a
        worker's cached prefix is neither pulled nor computed again)."""
        rid = req.request_id
        started = finished = ok = False
        streamed = 0  # output tokens the decode workers' deltas brought
        d: WorkerSlot | None = None
        replaced: WorkerSlot | None = None  # a worker found unavailable before its first token
        gen: Any = None
        try:
            while not finished:
                try:
                    d, prefer = (
                        (prefer, None)
                        if prefer is not None
                        else (self.choice.pick_decode(hashes), None)
                    )
                except NoLiveDecodeWorker as e:  # (the last ones died meanwhile)
                    finished = True
                    self._closed(rid, last_reported, "error")
                    yield _error_delta(req, str(e))
                    return
                if replaced is not None and replaced is not d:
                    # Unavailable may mean unreachable, not dead: it may have the request and run
                    # it to the end, its pages held for nobody. Told before another takes it (a
                    # dead one's call fails, which is all we wait for).
                    self._after([replaced.handle.abort.remote(rid)], lambda: None)
                elif replaced is not None:
                    # Picked again (no other is live): its old call is aborted first, answered
                    # before the new call goes (or the abort could meet the new one); the new
                    # call waits there until the old one has let the request's pages go.
                    with contextlib.suppress(Exception):
                        async with asyncio.timeout(min(ABORT_ORDER_WAIT_S, self._left_s(req))):
                            await replaced.handle.abort.remote(rid)
                replaced = None
                d.outstanding += 1
                active = 0  # context tokens this call holds on d (kv_aware weighs them)
                try:
                    if pre is None:
                        gen = d.handle.generate.options(num_returns="streaming").remote(req)
                    else:
                        gen = d.handle.decode.options(num_returns="streaming").remote(req, pre)
                    refs = gen.__aiter__()
                    while not finished:
                        try:
                            async with asyncio.timeout(max(self._left_s(req), 0.0)):
                                ref = await refs.__anext__()
                                # (a large delta, prompt logprobs say, may still be on its way
                                # from another node's object store)
                                delta: TokenDelta = await ref
                        except StopAsyncIteration:
                            break
                        started = True
                        if delta.kv_recomputed and pworker is not None:
                            # D prefilled it itself: P's lease would only pin its pages until
                            # it expires (a pull that failed to connect never reached P).
                            pworker.handle.cancel.remote(rid)
                        finished = delta.finish_reason is not None or delta.error is not None
                        ok = finished and delta.error is None
                        streamed += len(delta.token_ids)
                        grown = len(delta.token_ids) + (0 if active else len(req.prompt_token_ids))
                        d.active_tokens += grown
                        active += grown
                        yield delta
                    if not finished:
                        finished = True
                        yield _error_delta(
                            req,
                            f"decode worker {d.worker_id} ended the stream early",
                        )
                except asyncio.TimeoutError:
                    # Not ``finished``: the ``finally`` below aborts it on the decode worker.
                    yield _timeout_delta(req, self.call_timeout_s)
                    return
                except RayActorError as e:
                    note_unavailable(d, e)
                    if started or self._left_s(req) <= DECODE_RETRY_PAUSE_S:
                        finished = True
                        if not isinstance(e, ActorDiedError):  # unavailable: it may decode on
                            d.handle.abort.remote(rid)  # (for nobody, its pages held till done)
                        # A decode worker that died reports nothing: the prefill's report is the
                        # last the collector gets (it waited for D's until its pending bound).
                        self._closed(rid, last_reported, "error", streamed)
                        yield _worker_failed(req, d.worker_id, e)
                    else:
                        log.warning(
                            "decode worker %s unavailable for %s, trying again: %s",
                            d.worker_id,
                            rid,
                            e,
                        )
                        replaced = d
                        await asyncio.sleep(DECODE_RETRY_PAUSE_S)
                except RayTaskError as e:
                    finished = True
                    yield _worker_failed(req, d.worker_id, e)
                finally:
                    d.outstanding -= 1
                    d.active_tokens -= active
        finally:
            aborted = None
            if not finished and d is not None:  # the client went away (generator closed/cancelled)
                if gen is not None:
                    ray.cancel(gen)
                # With the prompt's length: D reports the request itself if the cancel stopped
                # its call before it ran (nothing else would; as the last report when it was to
                # prefill it too: no prefill worker saw it).
                aborted = d.handle.abort.remote(
                    rid, len(req.prompt_token_ids), pre is None, req.prefill_attempt
                )
            if not ok and pworker is not None:
                # P may still hold the lease (D never pulled, or failed): give the pages back now
                # rather than at lease expiry. A pull still reading them keeps them until it ends.
                # After D took the abort: a pull the ended lease refuses is then D's abort, not
                # a transfer failure (the two calls to two actors would race).
                self._after(
                    [] if aborted is None else [aborted], lambda: pworker.handle.cancel.remote(rid)
                )

    async def abort(self, request_id: str) -> None:
        """Abort ``request_id`` everywhere: the decode workers first, the prefill workers once
        those took it (as ``_stream_decode`` orders its own cleanup)."""
        taken = [w.handle.abort.remote(request_id) for w in self.decode]
        for w in self.prefill:
            self._after(taken, lambda w=w: w.handle.cancel.remote(request_id))

    # ---- health ----
    def health(self) -> dict[str, Any]:
        """Healthy when some decode worker is (as the stats poller and the calls last saw it)."""
        workers = {w.worker_id: w.healthy for w in self.prefill + self.decode}
        healthy = any(w.healthy for w in self.decode)
        return {"healthy": healthy, "workers": workers, "time": time.time()}
