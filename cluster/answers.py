"""An OpenAI answer from a request's deltas: its ``n`` choices, each one GenerateRequest (seeded as
vLLM seeds them), collected whole or streamed as server-sent events. A choice that ends with an
error ends the answer; a client that goes away aborts every choice not yet finished (it would hold
pages until its end)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from cluster import openai_responses as resp
from cluster.http_errors import error_kind, error_response
from engine.logprobs import TokenLogprobs
from worker_common.messages import GenerateRequest, TokenDelta

log = logging.getLogger(__name__)

# (choice index, a delta of it) -> one chunk of a streamed answer
MakeChunk = Callable[[int, TokenDelta], dict[str, Any]]
# one per prompt token (the first None), when the request asked for prompt logprobs
PromptLogprobs = tuple[TokenLogprobs | None, ...] | None


@dataclass(frozen=True)
class Choice:
    """One choice of a whole (non-streamed) answer."""

    text: str
    end: resp.Ending
    token_ids: list[int]
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token, when the request asked
    prompt_logprobs: PromptLogprobs = None
    cached_tokens: int = 0  # prompt tokens its worker read from a prefix cache


def cached_prompt_tokens(cached: list[int], n: int) -> int:
    """The usage's cached_tokens of an answer whose choices (``n`` per prompt, in order) each read
    ``cached`` prompt tokens from a prefix cache: each prompt counted once, as prompt_tokens
    counts it, by its choice that read the least (the others may have read what it computed)."""
    return sum(min(cached[k : k + n]) for k in range(0, len(cached), n))


def whole_usage(prompt_tokens: int, choices: list[Choice], n: int) -> dict[str, Any]:
    """The usage of a whole answer: ``prompt_tokens`` (every prompt once), its ``choices``
    (``n`` per prompt)."""
    made = sum(len(c.token_ids) for c in choices)
    cached = cached_prompt_tokens([c.cached_tokens for c in choices], n)
    return resp.usage(prompt_tokens, made, cached)


def choice_requests(req: GenerateRequest, n: int) -> list[GenerateRequest]:
    """``req`` as ``n`` requests, ``<id>-<index>``; with a seed, choice i samples with seed + i
    (vLLM's rule: the choices differ, and the same body gives the same answer again). Only the
    first computes the prompt's logprobs, for all of them (the others may then read the prompt
    from the prefix cache): a whole answer takes them from the first choice, a stream through
    ``sharing_prompt_logprobs``."""
    if n == 1:
        return [req]
    out = []
    for i in range(n):
        sampling = req.sampling.for_choice(i)
        out.append(dataclasses.replace(req, request_id=f"{req.request_id}-{i}", sampling=sampling))
    return out


def sharing_prompt_logprobs(
    reqs: list[GenerateRequest], streams: list[AsyncIterator[TokenDelta]], n: int
) -> list[AsyncIterator[TokenDelta]]:
    """The ``streams`` of ``reqs``, ``n`` choices per prompt made by ``choice_requests``: a
    choice that did not ask for its prompt's logprobs while its prompt's first choice did gets
    them on its first delta, which waits for the first choice's (a streamed choice echoes its
    prompt's logprobs with its first chunk, and may come before the first choice's)."""
    out = list(streams)
    for first in range(0, len(reqs), n):
        lender = reqs[first].sampling.prompt_logprobs is not None
        borrowers = [
            j
            for j in range(first + 1, min(first + n, len(reqs)))
            if reqs[j].sampling.prompt_logprobs is None
        ]
        if not lender or not borrowers:
            continue
        scored: asyncio.Future[PromptLogprobs] = asyncio.get_running_loop().create_future()
        out[first] = _lending(streams[first], scored)
        for j in borrowers:
            out[j] = _borrowing(streams[j], scored)
    return out


async def _lending(
    stream: AsyncIterator[TokenDelta], scored: asyncio.Future[PromptLogprobs]
) -> AsyncIterator[TokenDelta]:
    try:
        async for d in stream:
            if not scored.done():  # (the first delta brings the prompt's logprobs)
                scored.set_result(d.prompt_logprobs)
            yield d
    finally:
        if not scored.done():  # ended before any delta: the borrowers fail as a choice whose
            scored.set_result(None)  # worker sent none would (openai_logprobs.computed)


async def _borrowing(
    stream: AsyncIterator[TokenDelta], scored: asyncio.Future[PromptLogprobs]
) -> AsyncIterator[TokenDelta]:
    first = True
    try:
        async for d in stream:
            if first and not d.error:
                # (shielded: a cancelled borrower must not cancel what the others wait for)
                d = dataclasses.replace(d, prompt_logprobs=await asyncio.shield(scored))
            first = False
            yield d
    finally:
        # Cancelled while waiting, the stream is not the one cancelled: closed here, so that its
        # own cleanup (the router's abort) runs now, as merged promises.
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


_ENDED = object()


async def merged(streams: list[AsyncIterator[TokenDelta]]) -> AsyncIterator[tuple[int, TokenDelta]]:
    """(choice index, delta) as the streams yield them. Leaving early closes every stream (each
    is cancelled, so its own cleanup, the router's abort, runs)."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[TokenDelta]) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((i, delta))
        except Exception as e:  # handed to the reader (a cancel is the reader's own)
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, _ENDED))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is _ENDED:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _until_disconnect(request: Request) -> None:
    """Return when the client has gone away (the body was already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class AnswerFailed(Exception):
    """A request ended with an error delta: its text is written for the client (the router's
    and the workers' reasons; their exceptions' own text stays in the logs). ``status``: 504 for
    a request that ran out of time (server.request_timeout_s), else 500."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


def failed_status(delta: TokenDelta) -> int:
    return 504 if delta.timed_out else 500


def status_of(e: Exception) -> int:
    return e.status if isinstance(e, AnswerFailed) else 500


def told(e: Exception) -> str:
    """What a client is told of a failed answer: an AnswerFailed's reason; of any other failure
    (ours) its kind only, as the app's 500s (cluster/http_errors.py)."""
    if isinstance(e, AnswerFailed):
        return str(e)
    return f"internal error ({type(e).__name__}); the server's log has its details"


class Answers:
    """Answers over ``generate`` (the backend's), aborting through ``abort_later`` (in a task of
    its own: the caller may be being cancelled) and ``abort`` (awaited)."""

    def __init__(
        self,
        generate: Callable[[GenerateRequest], AsyncIterator[TokenDelta]],
        abort: Callable[[str], Any],
        abort_later: Callable[[str], None],
    ) -> None:
        self._generate = generate
        self._abort = abort
        self._abort_later = abort_later

    async def _collect(self, req: GenerateRequest) -> Choice:
        text: list[str] = []
        ids: list[int] = []
        logprobs: list[TokenLogprobs] = []
        prompt_logprobs = None
        cached = 0
        end = resp.GOING_ON
        async for d in self._generate(req):
            if d.error:
                raise AnswerFailed(d.error, failed_status(d))
            text.append(d.text)
            ids.extend(d.token_ids)
            logprobs.extend(d.logprobs)
            prompt_logprobs = prompt_logprobs or d.prompt_logprobs
            if d.num_cached_tokens is not None:
                cached = d.num_cached_tokens
            if d.finish_reason:
                end = resp.Ending(d.finish_reason, d.stop_reason)
        return Choice("".join(text), end, ids, tuple(logprobs), prompt_logprobs, cached)

    async def whole(
        self,
        reqs: list[GenerateRequest],
        request: Request,
        build: Callable[[list[Choice]], dict[str, Any]],
    ) -> Response:
        """A non-streamed answer: collect every choice, then ``build(choices)``."""
        tasks = [asyncio.ensure_future(self._collect(r)) for r in reqs]
        collect = asyncio.gather(*tasks)
        gone = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            collect.cancel()
            for r in reqs:
                self._abort_later(r.request_id)
            raise
        finally:
            gone.cancel()
        if not collect.done():  # the client went away
            collect.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await collect
            for r in reqs:
                await self._abort(r.request_id)
            return Response(status_code=499)
        try:
            choices = collect.result()
        except Exception as e:  # our own fault: the request was validated before
            log.warning("request %s failed: %s", reqs[0].request_id, e)
            # The other choices still run (gather leaves them): closed first, so that each runs
            # its own cleanup (the router's abort) and none is retried or decoded for nobody.
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for r in reqs:
                self._abort_later(r.request_id)
            return error_response(told(e), status_of(e))
        return JSONResponse(build(choices))

    async def stream(
        self,
        reqs: list[GenerateRequest],
        make_chunk: MakeChunk,
        include_usage: bool,
        prompt_tokens: int,
        first_chunks: list[dict[str, Any]] | None = None,
        continuous_usage: bool = False,
        n: int = 1,
    ) -> AsyncIterator[str]:
        """A streamed answer: a chunk per delta, naming its choice; an error event and then
        ``[DONE]`` whatever goes wrong. ``prompt_tokens``: the usage's, every prompt counted once.
        ``continuous_usage`` (vLLM's continuous_usage_stats): every chunk says its choice's usage
        so far. ``n``: choices per prompt (``choice_requests``'), which share its logprobs and
        count once in the usage. ``first_chunks``: each choice's opening chunks (a chat's role,
        its echo), sent with that choice's first output."""
        n_out = 0
        made = [0] * len(reqs)  # each choice's tokens so far
        cached = [0] * len(reqs)  # each choice's prompt tokens read from a prefix cache
        unfinished = {r.request_id for r in reqs}

        def usage_of(i: int) -> dict[str, Any]:
            # With include_usage, every chunk but the usage one says "usage": null (OpenAI's).
            if continuous_usage:
                return {"usage": resp.usage(len(reqs[i].prompt_token_ids), made[i], cached[i])}
            return {"usage": None} if include_usage else {}

        # Each choice's opening chunks go with its first output, as vLLM's: sent before it, they
        # read as the first token to a client timing its first chunk (vLLM's bench: TTFT ~0).
        opening: dict[int, list[dict[str, Any]]] = {}
        for chunk in first_chunks or []:
            opening.setdefault(chunk["choices"][0]["index"], []).append(chunk)
        try:
            try:
                streams = sharing_prompt_logprobs(reqs, [self._generate(r) for r in reqs], n)
                async for i, d in merged(streams):
                    if d.error:
                        unfinished.discard(reqs[i].request_id)  # (it ended on our side)
                        status = failed_status(d)
                        yield _sse(resp.error_body(d.error, error_kind(status), status))
                        break
                    for chunk in opening.pop(i, []):
                        yield _sse(chunk | usage_of(i))
                    n_out += len(d.token_ids)
                    made[i] += len(d.token_ids)
                    if d.num_cached_tokens is not None:
                        cached[i] = d.num_cached_tokens
                    if d.text or d.token_ids or d.finish_reason:
                        yield _sse(make_chunk(i, d) | usage_of(i))
                    if d.finish_reason:
                        unfinished.discard(reqs[i].request_id)
            except Exception as e:  # whatever failed, the client gets an error event and [DONE]
                log.warning("stream %s failed: %s", reqs[0].request_id, e)
                yield _sse(resp.error_body(told(e), "internal_error", 500))
            if include_usage:
                chunk = make_chunk(0, TokenDelta(reqs[0].request_id, [], ""))
                chunk["choices"] = []
                chunk["usage"] = resp.usage(prompt_tokens, n_out, cached_prompt_tokens(cached, n))
                yield _sse(chunk)
            yield "data: [DONE]\n\n"
        finally:
            # A client that went away mid-stream must not keep pages on any worker.
            for rid in unfinished:
                self._abort_later(rid)
