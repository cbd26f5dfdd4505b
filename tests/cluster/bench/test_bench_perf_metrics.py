"""Parsing and joining /perf_metrics (cluster/bench/perf_metrics.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cluster.bench.client import ClientSettings, StreamingClient
from cluster.bench.perf_metrics import (
    collect_server_timings,
    fetch_perf_metrics,
    join_server_timings,
    parse_perf_metrics,
)
from cluster.bench.records import BenchRequest, RequestRecord, ServerTimings


def test_parse_list_and_wrapped_forms() -> None:
    entry = {
        "request_id": "a",
        "prefill_queue_time": 0.1,
        "prefill_time": 0.2,
        "transfer_time": 0.3,
        "transfer_bytes": 4096,
        "decode_queue_time": 0.4,
        "extra": "ignored",
    }
    expected = {"a": ServerTimings(0.1, 0.2, 0.3, 4096, 0.4)}
    assert parse_perf_metrics([entry]) == expected
    assert parse_perf_metrics({"requests": [entry]}) == expected


def test_parse_prefix_hits_by_medium_and_who_prefilled() -> None:
    entry = {
        "request_id": "a",
        "prompt_tokens": 100,
        "cached_tokens_by_medium": {"device": 32, "host": 48},
        "prefill": None,
        "decode": {"worker_id": "decode-0"},
    }
    (timings,) = parse_perf_metrics([entry]).values()
    assert timings.prompt_tokens == 100 and timings.prefilled_on_decode is True
    assert timings.cached_tokens_by_medium == {"device": 32, "host": 48}
    disaggregated = {**entry, "prefill": {"worker_id": "prefill-0"}}
    assert parse_perf_metrics([disaggregated])["a"].prefilled_on_decode is False
    assert parse_perf_metrics([{"request_id": "b"}])["b"].prefilled_on_decode is None


def test_parse_skips_malformed_and_keeps_partial_entries() -> None:
    payload = [
        {"prefill_time": 1.0},
        "junk",
        {"request_id": "b", "prefill_time": "slow", "transfer_bytes": 8.0},
    ]
    assert parse_perf_metrics(payload) == {"b": ServerTimings(transfer_bytes=8)}
    assert parse_perf_metrics({"other": 1}) == {}


def test_join_by_response_id() -> None:
    a = RequestRecord(index=0, prompt_len=1, max_tokens=1, response_id="x")
    b = RequestRecord(index=1, prompt_len=1, max_tokens=1, response_id="")
    timings = {"x": ServerTimings(prefill_s=0.5), "": ServerTimings(prefill_s=9.0)}
    assert join_server_timings([a, b], timings) == 1
    assert a.server == ServerTimings(prefill_s=0.5) and b.server is None


def test_fetch_after_requests_from_a_duet_like_server(duet_server: Any) -> None:
    async def go() -> tuple[list[RequestRecord], Any, Any]:
        await fetch_perf_metrics(duet_server.url)  # drain what other tests left
        async with StreamingClient(
            ClientSettings(base_url=duet_server.url, model=duet_server.model)
        ) as client:
            records = [
                await client.send(i, BenchRequest([7] * n, n, 3)) for i, n in enumerate((4, 10))
            ]
        return (
            records,
            await fetch_perf_metrics(duet_server.url),
            await fetch_perf_metrics(duet_server.url),
        )

    records, timings, drained = asyncio.run(go())
    assert join_server_timings(records, timings) == 2
    # the server derives its timings from the prompt length: each entry went to its own request
    assert [r.server.transfer_bytes for r in records] == [4000, 10000]  # type: ignore[union-attr]
    assert records[1].server.prefill_s == pytest.approx(0.02)  # type: ignore[union-attr]
    assert drained == {}


def test_fetch_from_a_peer_without_the_route(peer_server: Any, free_port: int) -> None:
    assert asyncio.run(fetch_perf_metrics(peer_server.url)) is None
    assert asyncio.run(fetch_perf_metrics(f"http://127.0.0.1:{free_port}")) is None


def _send_two(url: str) -> list[RequestRecord]:
    async def go() -> list[RequestRecord]:
        async with StreamingClient(ClientSettings(base_url=url, model="tiny-echo")) as client:
            return [
                await client.send(i, BenchRequest([7] * n, n, 3)) for i, n in enumerate((4, 10))
            ]

    return asyncio.run(go())


def test_collect_waits_for_late_entries(start_echo: Any) -> None:
    with start_echo(perf_delay_s=0.3) as server:
        records = _send_two(server.url)
        assert (
            asyncio.run(collect_server_timings(server.url, records, wait_s=10.0, poll_s=0.05)) == 2
        )
    assert [r.server.transfer_bytes for r in records] == [4000, 10000]  # type: ignore[union-attr]


def test_collect_gives_up_after_the_wait(start_echo: Any) -> None:
    with start_echo(perf_delay_s=30.0) as server:
        records = _send_two(server.url)
        assert asyncio.run(collect_server_timings(server.url, records, wait_s=0.0)) == 0
    assert all(r.server is None for r in records)


def test_collect_stops_at_once_without_the_route(peer_server: Any) -> None:
    records = _send_two(peer_server.url)
    assert asyncio.run(collect_server_timings(peer_server.url, records, wait_s=30.0)) == 0
