"""A request added to a worker's engine loop and streamed as TokenDeltas: the decode worker's
shared streaming loop, for a request it prefills itself and for one whose KV it received."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from decode_worker.call_slots import CallSlot
from engine.engine_core import LLMEngine
from engine.engine_loop import EngineLoop
from engine.output_stream import OutputStream
from engine.outputs import RequestOutput
from worker_common.messages import GenerateRequest, TokenDelta
from worker_common.worker_stats import WorkerStatsKeeper


async def stream_request(
    loop: EngineLoop,
    keeper: WorkerStatsKeeper,
    req: GenerateRequest,
    add: Callable[[LLMEngine], Any],
    slot: CallSlot,
    computes_prompt: bool,
    token_deadline_s: float,
) -> AsyncIterator[TokenDelta]:
    """Add the request (``add``, on the engine thread) and stream its deltas. ``computes_prompt``:
    the prompt is computed here, so the first delta says how much of it was read from the prefix
    cache (a prompt received from P was P's to say, with the first token). Ended before its
    request finished (the client left, no token within ``token_deadline_s``), the request's abort
    and free are queued on the engine loop by the time the stream's close returns (so before any
    later call of the id is)."""
    rid = req.request_id
    stream = OutputStream(asyncio.get_running_loop())
    finished = False

    def add_and_check(e: LLMEngine) -> RequestOutput | None:
        # Subscribed here, on the engine thread, at the add: outputs of a step in flight
        # before it belong to an earlier request of the id (whose call just ended).
        loop.subscribe(rid, stream.push)
        # Decided on the engine thread, at the add: read later from here, ``is_finished``
        # could already be true from steps run meanwhile, whose tokens went to the stream.
        request = add(e)
        return RequestOutput.from_request(request) if request.is_finished else None

    try:
        # Shielded: a cancel while the add waits behind an engine step must not drop the add,
        # or nothing would report the request; added, it is aborted below and reported so.
        added = loop.call(add_and_check)
        slot.in_engine = True  # (an abort from now on is queued behind the add)
        done_at_add = await asyncio.shield(asyncio.wrap_future(added))
        if done_at_add is not None:  # the first token already met a stop condition
            finished = True
            loop.unsubscribe(rid)
            yield delta_of(done_at_add, False)  # (no prompt computed: nothing to say)
            return
        first = computes_prompt
        while not finished:
            out = await stream.get(token_deadline_s)
            finished = out.finished
            yield delta_of(out, first)
            first = False
    except asyncio.TimeoutError:
        yield TokenDelta(
            rid,
            [],
            "",
            "abort",
            len(req.prompt_token_ids),
            0,
            error=f"no token within {token_deadline_s}s (decode.token_deadline_s)",
        )
    finally:
        if not finished:
            # abort_request frees a request the scheduler knows; kv.free covers received pages
            # whose request never reached the scheduler (a no-op otherwise). Unsubscribed
            # there too: after the add, which subscribes, also when that is still queued.
            loop.call(
                lambda e: (
                    loop.unsubscribe(rid),
                    e.abort_request(rid),
                    e.kv.free(rid),
                    keeper.retire(rid),
                )
            )
        else:
            loop.call(lambda e: keeper.retire(rid))


def delta_of(out: RequestOutput, says_cached: bool) -> TokenDelta:
    """``out`` as a delta; ``says_cached``: with the prompt's prefix cache hit (the request's
    first delta from the worker that computed its prompt)."""
    return TokenDelta(
        request_id=out.request_id,
        token_ids=list(out.delta_token_ids),
        text=out.delta_text,
        finish_reason=out.finish_reason if out.finished else None,
        num_prompt_tokens=len(out.prompt_token_ids),
        num_output_tokens=len(out.token_ids),
        error=out.error,
        stop_reason=out.stop_reason if out.finished else None,
        logprobs=out.logprobs[len(out.token_ids) - len(out.delta_token_ids) :]
        if out.logprobs
        else (),
        # (with the first tokens: the prompt was computed here, as this call's first output)
        prompt_logprobs=out.prompt_token_logprobs
        if len(out.delta_token_ids) == len(out.token_ids)
        else None,
        num_cached_tokens=out.num_cached_tokens if says_cached else None,
    )
