"""Runs at one rate: concurrency cap, order, deadline (cluster/bench/runner.py) against a real server."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from typing import Any

import pytest

from cluster.bench.arrivals import arrival_offsets
from cluster.bench.client import ClientSettings, StreamingClient
from cluster.bench.records import BenchRequest
from cluster.bench.runner import ArrivalSettings, RunOutcome, default_deadline, run_requests


def run(
    url: str,
    requests: list[BenchRequest],
    arrivals: ArrivalSettings,
    deadline_s: float | None = 30.0,
) -> RunOutcome:
    async def go() -> RunOutcome:
        async with StreamingClient(ClientSettings(base_url=url, model="tiny-echo")) as client:
            return await run_requests(client, requests, arrivals, deadline_s, show_progress=False)

    return asyncio.run(go())


def workload(n: int, output_len: int = 3) -> list[BenchRequest]:
    return [
        BenchRequest(prompt=[i + 1] * (i + 1), prompt_len=i + 1, output_len=output_len)
        for i in range(n)
    ]


def test_all_at_once_with_concurrency_cap(start_echo: Any) -> None:
    with start_echo(per_token_s=0.005) as server:
        outcome = run(
            server.url, workload(8), ArrivalSettings(request_rate=math.inf, max_concurrency=2)
        )
        assert (
            server.state.max_in_flight == 2
        )  # eight requests due at once, never more than two streaming
    assert [r.index for r in outcome.records] == list(range(8))
    assert all(r.success for r in outcome.records)
    assert [r.prompt_len for r in outcome.records] == list(range(1, 9))
    assert not outcome.deadline_hit
    assert outcome.duration_s >= max(r.end for r in outcome.records) - min(
        r.start for r in outcome.records
    )


def test_the_duration_runs_from_the_runs_start_as_vllms(start_echo: Any) -> None:
    # As `vllm bench serve` measures it: the first arrival gap (with a ramp-up, the rate's slow
    # start) is in the run's duration, so both tools give the same server the same throughput.
    settings = ArrivalSettings(request_rate=2.0, ramp_up_s=3.0, seed=1)
    first_offset = arrival_offsets(2, 2.0, 1.0, 3.0, 1)[0]
    assert first_offset > 0.5
    with start_echo(per_token_s=0.001) as server:
        outcome = run(server.url, workload(2), settings)
    first, last = min(r.start for r in outcome.records), max(r.end for r in outcome.records)
    assert all(r.success for r in outcome.records)
    assert outcome.duration_s >= last - first + first_offset


def test_a_later_turn_waits_for_the_previous_one(start_echo: Any) -> None:
    first = BenchRequest(prompt=[1, 2], prompt_len=2, output_len=6)
    second = BenchRequest(prompt=[1, 2, 3], prompt_len=3, output_len=1, after=0)
    with start_echo(per_token_s=0.02) as server:
        outcome = run(server.url, [first, second], ArrivalSettings(request_rate=math.inf))
    a, b = outcome.records
    assert a.success and b.success and b.start >= a.end  # all due at once, yet sent after
    with pytest.raises(ValueError, match="request 0 follows request 1"):
        run("http://127.0.0.1:9", [replace(first, after=1), second], ArrivalSettings())


def test_poisson_arrivals_complete(duet_server: Any) -> None:
    outcome = run(duet_server.url, workload(5), ArrivalSettings(request_rate=200.0, seed=3))
    assert all(r.success for r in outcome.records)
    assert sum(r.output_tokens for r in outcome.records) == 15


def test_deadline_cuts_unfinished_requests(start_echo: Any) -> None:
    with start_echo(per_token_s=0.05) as server:
        requests = workload(2, output_len=2) + [
            BenchRequest(prompt=[1], prompt_len=1, output_len=400)
        ]
        outcome = run(server.url, requests, ArrivalSettings(request_rate=math.inf), deadline_s=1.0)
    assert outcome.deadline_hit
    assert [r.success for r in outcome.records] == [True, True, False]
    assert outcome.records[2].error == "not finished within the run deadline of 1.0 s"


def test_rejects_zero_concurrency(duet_server: Any) -> None:
    with pytest.raises(ValueError, match="max concurrency"):
        run(duet_server.url, workload(1), ArrivalSettings(max_concurrency=0))


def test_the_default_deadline_lets_every_request_use_its_own_timeout() -> None:
    """A fixed 600 s cut long low-rate runs whose every request was on time: the default is the
    last arrival plus a request timeout per request that may wait for another before its own."""
    four = workload(4)
    assert default_deadline(four, [0.0, 300.0, 500.0, 700.0], None, 300.0) == 700.0 + 300.0 + 5.0
    # Under a cap of 2, four requests at once may run as two waves.
    assert default_deadline(four, [0.0] * 4, 2, 300.0) == 2 * 300.0 + 5.0
    # A conversation of three turns: each turn waits for the one before it.
    turns = [
        BenchRequest(prompt=[1], prompt_len=1, output_len=1),
        BenchRequest(prompt=[1], prompt_len=1, output_len=1, after=0),
        BenchRequest(prompt=[1], prompt_len=1, output_len=1, after=1),
    ]
    assert default_deadline(turns, [0.0] * 3, None, 10.0) == 3 * 10.0 + 5.0


def test_a_run_without_a_deadline_gets_the_default_and_says_so(duet_server: Any) -> None:
    async def go() -> RunOutcome:
        settings = ClientSettings(
            base_url=duet_server.url, model="tiny-echo", request_timeout_s=7.0
        )
        async with StreamingClient(settings) as client:
            return await run_requests(client, workload(2), ArrivalSettings(), None, False)

    outcome = asyncio.run(go())
    assert all(r.success for r in outcome.records) and not outcome.deadline_hit
    assert outcome.deadline_s == 7.0 + 5.0  # both due at once: one timeout
