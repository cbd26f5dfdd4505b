"""DecodeWorker: receives a request's KV from a prefill worker and joins it to the continuous batch.

Life of a request here (DESIGN section 3):
  gen-init (allocate pages for the prompt plus the next token, minus D's own prefix hit)
  -> pull the remaining pages from P -> check (every chunk arrived, declared history == prompt length)
  -> finalize context (commit the prompt's pages) and only then schedule decode -> stream tokens.
Pages allocated for a receive are freed only after the receive is known finished or failed, even
when the client went away meanwhile. A failed, expired or refused pull fails the request, or with
``on_failure="recompute"`` (transfer.on_failure) the request is prefilled here instead and the
client gets a normal completion. The same class also serves whole requests locally (the
aggregated mode, and the fallback when no prefill worker is healthy).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from cluster.messages import RequestTimings, Role
from engine.engine_core import LLMEngine
from engine.engine_loop import EngineLoop
from engine.output_stream import OutputStream
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.worker_messages import GenerateRequest, PrefillResult, TokenDelta

log = logging.getLogger(__name__)


class KVPuller(Protocol):
    """The decode side of the transceiver (transfer.KVReceiver)."""

    async def pull(
        self,
        ticket: Any,
        dst_page_ids: dict[str, list[int]],
        skip_pages: int,
        expected_prompt_len: int,
    ) -> Any: ...  # -> an object with .ok, .error, .bytes
    def stats(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


class DecodeWorker:
    """Plain class behind the decode Ray actor."""

    def __init__(
        self,
        worker_id: str,
        engine: LLMEngine,
        puller: KVPuller | None,
        report: Callable[[RequestTimings], None] | None = None,
        gen_init_deadline_s: float = 60.0,
        token_deadline_s: float = 300.0,
        on_failure: str = "fail",
    ) -> None:
        if on_failure not in ("fail", "recompute"):
            raise ValueError(f"on_failure must be 'fail' or 'recompute', got {on_failure!r}")
        self.worker_id = worker_id
        self.loop = EngineLoop(engine, name=f"{worker_id}-engine")
        self.puller = puller
        self._report = report
        self._gen_init_deadline_s = gen_init_deadline_s
        self._token_deadline_s = token_deadline_s
        self._receiving: dict[str, asyncio.Task] = {}  # request id -> its pull, while in flight
        self._aborted: set[str] = set()
        self.on_failure = on_failure
        self.num_transfer_failures = 0  # failed pulls (and pulls that could not run)
        self.num_transfer_recomputed = 0  # ... whose request was prefilled here instead
        self.num_transfer_failed_requests = 0  # ... whose request ended with an error

    # ---- disaggregated path ----
    async def decode(self, req: GenerateRequest, pre: PrefillResult) -> AsyncIterator[TokenDelta]:
        """Receive the KV of a prefilled request and stream its tokens after the first one."""
        if self.puller is None:
            raise RuntimeError(
                f"decode worker {self.worker_id} has no transceiver (aggregated mode)"
            )
        rid, prompt = req.request_id, req.prompt_token_ids
        params = SamplingParams(**req.sampling)
        received = time.time()
        skip, dst = await self._gen_init(rid, prompt)
        transfer_start = time.time()
        pull = asyncio.ensure_future(self.puller.pull(pre.ticket, dst, skip, len(prompt)))
        self._receiving[rid] = pull
        try:
            result = await asyncio.shield(pull)
        except asyncio.CancelledError:
            # The client went away mid-receive: the pages stay held until the pull ends either way.
            self._aborted.discard(rid)
            pull.add_done_callback(lambda _: self._free_pages(rid))
            raise
        except Exception as e:  # the pull could not run at all (the receiver closed, say)
            result, error = None, f"{type(e).__name__}: {e}"
        finally:
            self._receiving.pop(rid, None)
        transfer_end = time.time()
        ok = result is not None and result.ok
        aborted = rid in self._aborted
        if aborted or not ok:
            self._aborted.discard(rid)
            await asyncio.wrap_future(self._free_pages(rid))
        if not ok:
            self.num_transfer_failures += 1
        if aborted:
            return
        extra = {
            "transfer_start": transfer_start,
            "transfer_end": transfer_end,
            "transfer_bytes": int(result.bytes) if ok else 0,
            "transfer_path": result.stats.path if result is not None else None,
        }
        first = pre.first_token_id

        def add_prefilled(e: LLMEngine) -> Any:
            return e.add_prefilled_request(
                rid, prompt, first, params, arrival_time=req.arrival_time
            )

        def add_recomputed(e: LLMEngine) -> Any:
            return e.add_recomputed_request(
                rid, prompt, first, params, arrival_time=req.arrival_time
            )

        if not ok:
            why = result.error if result is not None else error
            if self.on_failure != "recompute":
                self.num_transfer_failed_requests += 1
                yield TokenDelta(
                    rid, [], "", "abort", len(prompt), 1, error=f"KV transfer failed: {why}"
                )
                return
            log.warning("KV transfer of %s failed (%s): prefilling it here", rid, why)
            self.num_transfer_recomputed += 1
        async for delta in self._run(req, received, add_prefilled if ok else add_recomputed, extra):
            yield delta

    async def _gen_init(self, rid: str, prompt: list[int]) -> tuple[int, dict[str, list[int]]]:
        """Allocate pages for the prompt and the next token; return (pages D already had, the pages
        the transfer must fill per group). Waits for free pages, within a deadline."""

        def allocate(engine: LLMEngine) -> tuple[int, dict[str, list[int]]] | None:
            prefix = engine.kv.match_prefix(prompt)
            if not engine.kv.allocate_slots(rid, len(prompt) + 1, prefix):
                return None
            n_hit = prefix.num_tokens // engine.kv.page_size
            n_prompt_pages = -(-len(prompt) // engine.kv.page_size)
            pages = engine.kv.page_ids(rid)
            return n_hit, {g: p[n_hit:n_prompt_pages] for g, p in pages.items()}

        deadline = time.monotonic() + self._gen_init_deadline_s
        while True:
            fut = self.loop.call(allocate)
            try:
                got = await asyncio.wrap_future(fut)
            except asyncio.CancelledError:
                # The client went away while the allocation was queued or running: pages it got
                # must not stay held under an id nobody will free.
                fut.add_done_callback(
                    lambda f: None if f.cancelled() or f.exception() else self._free_pages(rid)
                )
                raise
            if got is not None:
                return got
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"decode worker {self.worker_id}: no free KV pages for {rid} ({len(prompt)} prompt tokens) "
                    f"within {self._gen_init_deadline_s}s"
                )
            await asyncio.sleep(0.02)

    def _free_pages(self, rid: str) -> Any:
        return self.loop.call(lambda e: e.kv.free(rid))

    # ---- aggregated path ----
    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Prefill locally and stream every token (aggregated mode / no healthy prefill worker)."""
        rid = req.request_id
        params = SamplingParams(**req.sampling)
        received = time.time()
        async for delta in self._run(
            req,
            received,
            lambda e: e.add_request(
                rid, req.prompt_token_ids, params, arrival_time=req.arrival_time
            ),
            None,
        ):
            yield delta

    # ---- shared streaming loop ----
    async def _run(
        self,
        req: GenerateRequest,
        received: float,
        add: Callable[[LLMEngine], Any],
        transfer: dict[str, Any] | None,
    ) -> AsyncIterator[TokenDelta]:
        rid = req.request_id
        stream = OutputStream(asyncio.get_running_loop())
        self.loop.subscribe(rid, stream.push)
        finished = False
        last: RequestOutput | None = None
        gaps: list[float] = []
        try:
            request = await asyncio.wrap_future(self.loop.call(add))
            if request.is_finished:  # the first token already met a stop condition
                finished = True
                self.loop.unsubscribe(rid)
                last = RequestOutput.from_request(request)
                yield self._delta(last)
                return
            while not finished:
                out = await stream.get(self._token_deadline_s)
                if (
                    last is not None
                    and out.metrics.last_token_time
                    and last.metrics.last_token_time
                ):
                    gaps.append(out.metrics.last_token_time - last.metrics.last_token_time)
                last, finished = out, out.finished
                yield self._delta(out)
        except asyncio.TimeoutError:
            yield TokenDelta(
                rid,
                [],
                "",
                "abort",
                len(req.prompt_token_ids),
                0,
                error=f"no token within {self._token_deadline_s}s",
            )
        finally:
            if not finished:
                self.loop.unsubscribe(rid)
                # abort_request frees a request the scheduler knows; kv.free covers received pages
                # whose request never reached the scheduler (a no-op otherwise).
                self.loop.call(lambda e: (e.abort_request(rid), e.kv.free(rid)))
            if self._report and last is not None:
                self._report(self._timings(req, received, last, transfer, gaps, finished))

    @staticmethod
    def _delta(out: RequestOutput) -> TokenDelta:
        return TokenDelta(
            request_id=out.request_id,
            token_ids=list(out.delta_token_ids),
            text=out.delta_text,
            finish_reason=out.finish_reason if out.finished else None,
            num_prompt_tokens=len(out.prompt_token_ids),
            num_output_tokens=len(out.token_ids),
            error=out.error,
        )

    async def abort(self, request_id: str) -> None:
        """Stop a request: a receive in flight keeps its pages until it ends; a running one is freed."""
        if request_id in self._receiving:
            self._aborted.add(request_id)
            return
        await asyncio.wrap_future(self.loop.call(lambda e: e.abort_request(request_id)))

    def _timings(
        self,
        req: GenerateRequest,
        received: float,
        out: RequestOutput,
        transfer: dict[str, Any] | None,
        gaps: list[float],
        finished: bool,
    ) -> RequestTimings:
        m = out.metrics
        local = transfer is None
        return RequestTimings(
            request_id=req.request_id,
            role=Role.DECODE,
            worker_id=self.worker_id,
            arrival_time=received,
            queue_start=m.arrival_time if local else None,
            queue_end=m.first_scheduled_time,
            prefill_start=m.first_scheduled_time if local else None,
            prefill_end=m.first_token_time if local else None,
            first_token_time=m.first_token_time if local else None,
            transfer_start=None if local else transfer["transfer_start"],
            transfer_end=None if local else transfer["transfer_end"],
            transfer_bytes=0 if local else transfer["transfer_bytes"],
            transfer_path=None if local else transfer["transfer_path"],
            decode_start=m.first_scheduled_time,
            last_token_time=m.last_token_time,
            finish_time=m.finished_time or time.time(),
            prompt_tokens=len(req.prompt_token_ids),
            cached_tokens=m.num_cached_tokens,
            output_tokens=len(out.token_ids),
            token_gaps_s=tuple(gaps),
            finish_reason=(out.finish_reason if finished else "abort")
            if not out.error
            else "error",
            last_report=local,
        )

    def stats(self) -> dict[str, Any]:
        engine = self.loop.engine
        return {
            "worker_id": self.worker_id,
            "pid": os.getpid(),
            "role": "decode",
            "healthy": self.loop.alive,
            "num_waiting": engine.scheduler.num_waiting,
            "num_running": engine.scheduler.num_running,
            "num_receiving": len(self._receiving),
            "free_pages": sum(engine.kv.num_free_pages(g) for g in engine.kv.specs),
            "kv": engine.kv.stats(),
            "transfer": self.puller.stats() if self.puller else {},
            "transfer_failures": self.num_transfer_failures,
            "transfer_recomputed": self.num_transfer_recomputed,
            "transfer_failed_requests": self.num_transfer_failed_requests,
        }

    def close(self) -> None:
        try:
            if self.puller is not None:
                self.puller.close()
        finally:
            self.loop.stop()
