"""An answer's choices (cluster/answers.py) over scripted deltas: a prompt's choices share the
prompt logprobs its first choice computes, whichever choice's first delta comes first; a choice that
fails closes the others, streamed or whole."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cluster.answers import Answers, choice_requests
from engine.logprobs import TokenLogprobs
from engine.sampling_params import SamplingParams
from worker_common.messages import GenerateRequest, TokenDelta

SCORED = (None, TokenLogprobs(token_id=7, logprob=-0.5, rank=1, top=()))


def _requests(n: int) -> list[GenerateRequest]:
    sampling = SamplingParams(max_tokens=1, logprobs=0, prompt_logprobs=0)
    return choice_requests(GenerateRequest("r", [5, 7], sampling, arrival_time=0.0), n)


def _chunk(i: int, d: TokenDelta) -> dict[str, Any]:
    lent = None if d.prompt_logprobs is None else len(d.prompt_logprobs)
    return {"choices": [{"index": i, "text": d.text, "prompt_logprobs": lent}]}


def _choices(events: list[str]) -> list[dict[str, Any]]:
    return [c for e in events if e.startswith("data: {") for c in json.loads(e[6:])["choices"]]


def test_only_the_first_choice_of_a_prompt_asks_for_its_prompt_logprobs() -> None:
    assert [r.sampling.prompt_logprobs for r in _requests(3)] == [0, None, None]


def test_a_choice_that_comes_first_waits_for_the_prompt_logprobs_of_the_first() -> None:
    """Choice 1's first delta comes before choice 0's: it is held until choice 0's brings the
    prompt's logprobs, and then carries them; choice 0 and the others go on as they come."""

    async def run() -> list[dict[str, Any]]:
        lent = asyncio.Event()

        async def generate(req: GenerateRequest) -> AsyncIterator[TokenDelta]:
            if req.request_id == "r-0":
                await asyncio.sleep(0.05)  # (it computes the whole prompt)
                lent.set()
                yield TokenDelta(req.request_id, [1], "a", "length", prompt_logprobs=SCORED)
            else:
                assert not lent.is_set()
                yield TokenDelta(req.request_id, [2], "b", "length")

        answers = Answers(generate, lambda rid: None, lambda rid: None)
        return _choices([e async for e in answers.stream(_requests(2), _chunk, False, 2, n=2)])

    assert asyncio.run(run()) == [
        {"index": 0, "text": "a", "prompt_logprobs": 2},
        {"index": 1, "text": "b", "prompt_logprobs": 2},
    ]


def test_a_choice_left_waiting_is_closed_when_the_answer_fails() -> None:
    """Choice 2 fails while choice 1 waits for the prompt logprobs choice 0 has not sent: the
    answer ends with an error event, and by then every choice is closed (its own cleanup, the
    router's abort, has run), the waiting one too."""
    closed: list[str] = []

    async def run() -> tuple[list[str], list[str]]:
        async def choice(req: GenerateRequest) -> AsyncIterator[TokenDelta]:
            try:
                if req.request_id == "r-0":
                    await asyncio.sleep(10)
                elif req.request_id == "r-2":
                    await asyncio.sleep(0.05)
                    raise RuntimeError("the worker died")
                yield TokenDelta(req.request_id, [2], "b")
                await asyncio.sleep(10)
            finally:
                closed.append(req.request_id)

        kept = []  # (so that no garbage collection closes a stream the answer left open)

        def generate(req: GenerateRequest) -> AsyncIterator[TokenDelta]:
            kept.append(choice(req))
            return kept[-1]

        answers = Answers(generate, lambda rid: None, lambda rid: None)
        events = [e async for e in answers.stream(_requests(3), _chunk, False, 2, n=3)]
        await asyncio.sleep(0.01)  # (the answer cancels its choices' tasks as it ends)
        return events, sorted(closed)

    events, closed_by_then = asyncio.run(run())
    # (an exception of ours: the client is told its kind, not its text)
    assert "internal error (RuntimeError)" in events[0] and "the worker died" not in events[0]
    assert events[1:] == ["data: [DONE]\n\n"]
    assert closed_by_then == ["r-0", "r-1", "r-2"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_answer_tells_the_reason_written_for_the_client_and_no_other(stream: bool) -> None:
    """An error delta's reason (the router's, a worker's) is written for clients and reaches
    them; an exception's text (Ray's: addresses, pids, a remote traceback) does not."""
    from starlette.requests import Request

    async def answer(failure: BaseException | str) -> str:
        async def choice(req: GenerateRequest) -> AsyncIterator[TokenDelta]:
            if isinstance(failure, str):
                yield TokenDelta(req.request_id, [], "", "abort", 3, 0, error=failure)
                return
            raise failure
            yield  # (a generator)

        async def receive() -> dict[str, Any]:
            await asyncio.sleep(30)
            return {"type": "http.disconnect"}

        answers = Answers(choice, lambda rid: None, lambda rid: None)
        if stream:
            return "".join([e async for e in answers.stream(_requests(1), _chunk, False, 2)])
        request = Request({"type": "http", "method": "POST", "headers": []}, receive)
        response = await answers.whole(_requests(1), request, lambda choices: {})
        assert response.status_code == 500
        return bytes(response.body).decode()

    told = asyncio.run(answer("no prefill worker could serve the request"))
    assert "no prefill worker could serve the request" in told
    leaked = asyncio.run(answer(RuntimeError("ray::Decode.decode() (pid=23019, ip=192.0.2.2)")))
    assert "192.0.2.2" not in leaked and "internal error (RuntimeError)" in leaked


def test_a_whole_answer_that_fails_closes_its_other_choices_before_it_aborts() -> None:
    """Choice 1 fails while choices 0 and 2 are still running: the answer is a 500, and by the
    time the router's abort is asked for, every other choice was closed (gather left them
    running, and the abort then made the router retry their prefills elsewhere)."""
    from starlette.requests import Request

    closed: list[str] = []
    aborts: list[tuple[str, list[str]]] = []

    async def run() -> int:
        async def choice(req: GenerateRequest) -> AsyncIterator[TokenDelta]:
            try:
                if req.request_id == "r-1":
                    await asyncio.sleep(0.05)
                    raise RuntimeError("the worker died")
                await asyncio.sleep(10)
                yield TokenDelta(req.request_id, [2], "b", "length")
            finally:
                closed.append(req.request_id)

        async def receive() -> dict[str, Any]:
            await asyncio.sleep(30)  # (the client stays)
            return {"type": "http.disconnect"}

        request = Request({"type": "http", "method": "POST", "headers": []}, receive)
        answers = Answers(
            choice, lambda rid: None, lambda rid: aborts.append((rid, sorted(closed)))
        )
        response = await answers.whole(_requests(3), request, lambda choices: {})
        return response.status_code

    assert asyncio.run(run()) == 500
    assert sorted(closed) == ["r-0", "r-1", "r-2"]
    assert aborts == [(f"r-{i}", ["r-0", "r-1", "r-2"]) for i in range(3)]


def test_a_choices_opening_chunk_goes_with_its_first_output() -> None:
    """The chat's role chunk is sent with the choice's first token, not before it is computed:
    a client that times its first chunk (vLLM's bench) would read the prefill as no time."""
    produced: list[str] = []

    async def run() -> list[tuple[str, list[str]]]:
        async def generate(req: GenerateRequest) -> AsyncIterator[TokenDelta]:
            await asyncio.sleep(0.05)  # (the prefill)
            produced.append(req.request_id)
            yield TokenDelta(req.request_id, [1], "a", "length")

        answers = Answers(generate, lambda rid: None, lambda rid: None)
        opening = [{"choices": [{"index": i, "role": "assistant"}]} for i in range(2)]
        seen = []
        async for e in answers.stream(_requests(2), _chunk, False, 2, opening, n=2):
            seen.append((e, list(produced)))
        return seen

    seen = asyncio.run(run())
    roles = [(json.loads(e[6:])["choices"][0]["index"], made) for e, made in seen if '"role"' in e]
    assert sorted(i for i, _ in roles) == [0, 1]
    assert all(f"r-{i}" in made for i, made in roles)  # (its first output was computed by then)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_out_of_time_is_a_504_timeout_not_an_internal_error(stream: bool) -> None:
    """server.request_timeout_s ran out (the router's timed_out delta): nothing failed, so the
    client gets 504 and type timeout_error, whole or in the stream's error event."""
    from starlette.requests import Request

    async def answer() -> tuple[int, dict[str, Any]]:
        async def choice(req: GenerateRequest) -> AsyncIterator[TokenDelta]:
            why = "the request took longer than server.request_timeout_s (3s)"
            yield TokenDelta(req.request_id, [], "", "abort", 3, 0, error=why, timed_out=True)

        async def receive() -> dict[str, Any]:
            await asyncio.sleep(30)
            return {"type": "http.disconnect"}

        answers = Answers(choice, lambda rid: None, lambda rid: None)
        if stream:
            events = [e async for e in answers.stream(_requests(1), _chunk, False, 2)]
            body = json.loads(events[0][len("data: ") :])
            return body["error"]["code"], body
        request = Request({"type": "http", "method": "POST", "headers": []}, receive)
        response = await answers.whole(_requests(1), request, lambda choices: {})
        return response.status_code, json.loads(bytes(response.body))

    code, body = asyncio.run(answer())
    assert code == 504 and body["error"]["type"] == "timeout_error"
    assert "server.request_timeout_s (3s)" in body["error"]["message"]
