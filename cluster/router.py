"""The router: the P/D state machine behind the HTTP server (it implements server.ServingBackend).

For each request: pick a prefill worker (queue length, and for ``prefix_aware`` the worker that saw
the same first page), get the first token and a transfer ticket, stream the first token, pick a decode
worker (free pages, running requests) and stream the rest from it. A failed prefill is retried on
another prefill worker (``router.prefill_retries``); with no healthy prefill worker the decode worker
prefills locally. A client that goes away cancels the request on both sides.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from engine.worker_messages import GenerateRequest, PrefillResult, TokenDelta

log = logging.getLogger(__name__)


@dataclass
class WorkerSlot:
    """The router's view of one worker actor."""

    worker_id: str
    handle: Any  # ray ActorHandle
    outstanding: int = 0
    free_pages: int = 0
    healthy: bool = True
    failures: int = 0
    last_stats: dict[str, Any] = field(default_factory=dict)


def _error_delta(req: GenerateRequest, error: str) -> TokenDelta:
    """The last delta of a request that failed on our side (the server answers 5xx)."""
    return TokenDelta(req.request_id, [], "", "abort", len(req.prompt_token_ids), 0, error=error)


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
        stats_interval_s: float = 1.0,
        call_timeout_s: float = 300.0,
    ) -> None:
        if not decode:
            raise ValueError("the router needs at least one decode worker")
        self.prefill = prefill
        self.decode = decode
        self.policy = policy
        self.prefill_retries = prefill_retries
        self.local_prefill_fallback = local_prefill_fallback
        self._turn = 0  # round_robin position
        self.page_size = page_size
        self.stats_interval_s = stats_interval_s
        self.call_timeout_s = call_timeout_s
        self._stats_task: asyncio.Task | None = None
        self.num_prefill_retries = 0
        self.num_local_fallbacks = 0

    # ---- choosing workers ----
    def _pick_prefill(self, req: GenerateRequest, exclude: set[str]) -> WorkerSlot | None:
        live = [w for w in self.prefill if w.healthy and w.worker_id not in exclude]
        if not live:
            return None
        if self.policy == "round_robin":
            self._turn += 1
            return live[self._turn % len(live)]
        least = min(w.outstanding for w in live)
        if self.policy == "prefix_aware" and len(req.prompt_token_ids) >= self.page_size:
            # Requests sharing their first page go to the same worker (its prefix cache has it),
            # unless that worker is clearly busier than the least loaded one.
            key = hashlib.blake2b(
                str(req.prompt_token_ids[: self.page_size]).encode(), digest_size=8
            ).digest()
            preferred = live[int.from_bytes(key, "little") % len(live)]
            if preferred.outstanding <= least + 2:
                return preferred
        return min(live, key=lambda w: w.outstanding)

    def _pick_decode(self) -> WorkerSlot:
        live = [w for w in self.decode if w.healthy] or self.decode
        return min(live, key=lambda w: (w.outstanding, -w.free_pages))

    # ---- the request ----
    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        self._ensure_stats_task()
        pre, pworker = await self._prefill(req)
        if pre is None:
            if self.prefill and not self.local_prefill_fallback:
                yield _error_delta(
                    req, "no prefill worker could serve the request (local fallback is off)"
                )
                return
            self.num_local_fallbacks += 1
            async for d in self._stream_decode(req, None, None):
                yield d
            return
        n_prompt = len(req.prompt_token_ids)
        yield TokenDelta(
            req.request_id,
            [pre.first_token_id],
            pre.first_token_text,
            pre.finish_reason,
            n_prompt,
            1,
        )
        if pre.finish_reason is not None:
            return
        async for d in self._stream_decode(req, pre, pworker):
            yield d

    async def _prefill(
        self, req: GenerateRequest
    ) -> tuple[PrefillResult | None, WorkerSlot | None]:
        tried: set[str] = set()
        for attempt in range(1 + self.prefill_retries):
            w = self._pick_prefill(req, tried)
            if w is None:
                break
            tried.add(w.worker_id)
            w.outstanding += 1
            try:
                return await asyncio.wait_for(w.handle.prefill.remote(req), self.call_timeout_s), w
            except RayTaskError as e:
                if isinstance(e.cause, ValueError):
                    raise e.cause from None  # the request itself is bad: no retry
                log.warning("prefill of %s failed on %s: %s", req.request_id, w.worker_id, e)
            except (RayActorError, asyncio.TimeoutError) as e:
                if isinstance(e, asyncio.TimeoutError):  # it may still prefill and lease the KV
                    w.handle.cancel.remote(req.request_id)
                w.healthy = False  # until its stats answer again
                log.warning(
                    "prefill worker %s unavailable for %s: %s", w.worker_id, req.request_id, e
                )
            except asyncio.CancelledError:
                w.handle.cancel.remote(req.request_id)
                raise
            finally:
                w.outstanding -= 1
            w.failures += 1
            if attempt < self.prefill_retries:
                self.num_prefill_retries += 1
        return None, None

    async def _stream_decode(
        self, req: GenerateRequest, pre: PrefillResult | None, pworker: WorkerSlot | None
    ) -> AsyncIterator[TokenDelta]:
        """Stream from a decode worker. A worker that is unavailable before it produced anything (it
        is restarting, or died) is replaced, within ``call_timeout_s``; after the first token, its
        failure ends the request with an error (the tokens already sent cannot be recalled)."""
        rid = req.request_id
        deadline = time.monotonic() + self.call_timeout_s
        started = finished = ok = False
        d: WorkerSlot | None = None
        gen: Any = None
        try:
            while not finished:
                d = self._pick_decode()
                d.outstanding += 1
                try:
                    if pre is None:
                        gen = d.handle.generate.options(num_returns="streaming").remote(req)
                    else:
                        gen = d.handle.decode.options(num_returns="streaming").remote(req, pre)
                    async for ref in gen:
                        delta: TokenDelta = await ref
                        started = True
                        finished = delta.finish_reason is not None or delta.error is not None
                        ok = finished and delta.error is None
                        yield delta
                    if not finished:
                        finished = True
                        yield _error_delta(
                            req,
                            f"decode worker {d.worker_id} ended the stream early",
                        )
                except RayActorError as e:
                    d.healthy = False
                    if started or time.monotonic() > deadline:
                        finished = True
                        yield _error_delta(
                            req,
                            f"decode worker {d.worker_id} failed: {type(e).__name__}: {e}",
                        )
                    else:
                        log.warning(
                            "decode worker %s unavailable for %s, trying again: %s",
                            d.worker_id,
                            rid,
                            e,
                        )
                        await asyncio.sleep(0.5)
                except RayTaskError as e:
                    finished = True
                    yield _error_delta(
                        req,
                        f"decode worker {d.worker_id} failed: {type(e).__name__}: {e}",
                    )
                finally:
                    d.outstanding -= 1
        finally:
            if not finished and d is not None:  # the client went away (generator closed/cancelled)
                if gen is not None:
                    ray.cancel(gen)
                d.handle.abort.remote(rid)
            if not ok and pworker is not None:
                # P may still hold the lease (D never pulled, or failed): give the pages back now
                # rather than at lease expiry. A pull still reading them keeps them until it ends.
                pworker.handle.cancel.remote(rid)

    async def abort(self, request_id: str) -> None:
        for w in self.decode:
            w.handle.abort.remote(request_id)
        for w in self.prefill:
            w.handle.cancel.remote(request_id)

    # ---- health and stats ----
    def _ensure_stats_task(self) -> None:
        if self._stats_task is None or self._stats_task.done():
            self._stats_task = asyncio.get_running_loop().create_task(self._poll_stats())

    async def _poll_stats(self) -> None:
        while True:
            await self.refresh_stats()
            await asyncio.sleep(self.stats_interval_s)

    async def refresh_stats(self) -> None:
        async def one(w: WorkerSlot) -> None:
            try:
                s = await asyncio.wait_for(w.handle.stats.remote(), max(self.stats_interval_s, 5.0))
            except (RayActorError, RayTaskError, asyncio.TimeoutError):
                w.healthy = False
                return
            w.last_stats = s
            w.healthy = bool(s.get("healthy", True))
            w.free_pages = int(s.get("free_pages", 0))

        await asyncio.gather(*(one(w) for w in self.prefill + self.decode))

    async def health(self) -> dict[str, Any]:
        await self.refresh_stats()
        workers = {w.worker_id: w.healthy for w in self.prefill + self.decode}
        healthy = any(w.healthy for w in self.decode)
        return {"healthy": healthy, "workers": workers, "time": time.time()}

    def close(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
