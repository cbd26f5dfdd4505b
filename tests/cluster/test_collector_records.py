"""PerfRecord: the latencies derived from one request's joined timings, and its JSON form."""

from __future__ import annotations

import json

import pytest

from cluster.bench.perf_metrics import parse_perf_metrics
from cluster.messages import PerfRecord, RequestTimings, Role
from tests.cluster.conftest import decode_timings, prefill_timings


def test_disaggregated_latencies() -> None:
    record = PerfRecord("r1", prefill=prefill_timings("r1"), decode=decode_timings("r1"))
    assert record.arrival_time == 100.0
    assert record.ttft_s == 0.75
    assert record.e2e_s == 3.0
    assert record.prefill_time_s == 0.5
    assert record.transfer_latency_s == 0.5
    assert record.transfer_bytes == 4096
    assert record.prompt_tokens == 32
    assert record.output_tokens == 5  # the first token from P, four from D
    assert record.tpot_s == (103.0 - 100.75) / 4
    # D's own gaps, after the one from P's first token (100.75) to D's first (101.75)
    assert record.token_gaps_s == (1.0, 0.25, 0.5, 0.5)
    assert sum(record.token_gaps_s) == record.tpot_s * (record.output_tokens - 1)
    assert record.queue_time_s(Role.PREFILL) == 0.25
    assert record.queue_time_s(Role.DECODE) == 0.125
    assert record.finish_reason == "length"


def test_latencies_run_from_the_routers_arrival_failed_attempts_included() -> None:
    """A request that reached the router at 70 and whose first prefill attempt failed: its TTFT
    and end-to-end latency count from 70, as its client waited, not from the arrival of the
    attempt that served it (100: a healthy 0.75 s TTFT while the client waited 30.75 s)."""
    record = PerfRecord(
        "r9",
        prefill=prefill_timings("r9", router_arrival_time=70.0, prefill_attempt=1),
        decode=decode_timings("r9", router_arrival_time=70.0, prefill_attempt=1),
        failed_prefill_attempts=1,
    )
    assert (record.ttft_s, record.e2e_s) == (30.75, 33.0)
    assert record.queue_time_s(Role.PREFILL) == 0.25  # (the worker's own queue)


def test_aggregated_latencies_come_from_the_decode_worker() -> None:
    decode = decode_timings(
        "r2",
        arrival_time=10.0,
        prefill_start=10.5,
        prefill_end=11.0,
        first_token_time=11.0,
        transfer_start=None,
        transfer_end=None,
        transfer_bytes=0,
        last_token_time=12.0,
        finish_time=12.0,
        prompt_tokens=8,
        output_tokens=3,
        last_report=True,
    )
    record = PerfRecord("r2", prefill=None, decode=decode)
    assert (record.ttft_s, record.e2e_s, record.prefill_time_s) == (1.0, 2.0, 0.5)
    assert record.transfer_latency_s is None and record.transfer_bytes == 0
    assert (record.prompt_tokens, record.output_tokens, record.tpot_s) == (8, 3, 0.5)
    assert record.queue_time_s(Role.PREFILL) is None


def test_request_that_ended_on_the_prefill_worker() -> None:
    prefill = prefill_timings(
        "r3", transfer_start=None, transfer_end=None, finish_reason="abort", last_report=True
    )
    record = PerfRecord("r3", prefill=prefill, decode=None)
    assert (record.ttft_s, record.e2e_s) == (0.75, 1.5)
    assert record.output_tokens == 1 and record.tpot_s is None
    assert record.finish_reason == "abort"


def test_a_request_whose_decode_worker_died_counts_the_tokens_it_streamed() -> None:
    """P's report (its first token, handed off) closed by the router after the decode worker
    died having streamed 4 tokens: 5 output tokens, as the client got; no TPOT (the dead
    worker's tokens have no times)."""
    record = PerfRecord(
        "r4", prefill_timings("r4"), None, closed_reason="error", closed_decoded_tokens=4
    )
    assert (record.output_tokens, record.tpot_s, record.finish_reason) == (5, None, "error")
    assert record.to_dict()["output_tokens"] == 5


def test_local_prefill_fallback_ignores_the_failed_attempt_on_the_prefill_worker() -> None:
    failed = prefill_timings("r4", transfer_end=None, finish_reason="error")  # P ran, KV never came
    decode = decode_timings(
        "r4",
        prefill_start=102.0,
        prefill_end=102.25,
        first_token_time=102.5,
        transfer_start=None,
        transfer_end=None,
        transfer_bytes=0,
        prompt_tokens=32,
    )
    record = PerfRecord("r4", prefill=failed, decode=decode)
    assert record.ttft_s == 2.5  # from arrival at the prefill worker to D's own first token
    assert record.prefill_time_s == 0.25
    assert record.output_tokens == 4  # P's first token was thrown away with its KV
    assert record.tpot_s == 0.5 / 3
    assert record.transfer_latency_s is None
    assert record.finish_reason == "length"


def test_needs_one_role() -> None:
    with pytest.raises(ValueError, match="needs at least one role"):
        PerfRecord("r5", prefill=None, decode=None)


def test_role_accepts_its_string_value() -> None:
    assert RequestTimings("r6", "decode", "d0").role is Role.DECODE  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RequestTimings("r6", "router", "x")  # type: ignore[arg-type]


def test_to_dict_is_json_and_what_the_bench_driver_reads() -> None:
    record = PerfRecord("r1", prefill=prefill_timings("r1"), decode=decode_timings("r1"))
    entry = json.loads(json.dumps(record.to_dict()))
    assert entry["prefill"]["role"] == "prefill" and entry["decode"]["token_gaps_s"] == [
        0.25, 0.5, 0.5,
    ]  # fmt: skip
    assert (entry["ttft"], entry["e2e"], entry["output_tokens"]) == (0.75, 3.0, 5)
    timings = parse_perf_metrics([entry])["r1"]
    assert timings.prefill_queue_s == 0.25
    assert timings.prefill_s == 0.5
    assert timings.transfer_s == 0.5
    assert timings.transfer_bytes == 4096
    assert timings.decode_queue_s == 0.125
