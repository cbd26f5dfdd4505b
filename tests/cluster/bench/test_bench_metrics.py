"""Metric code against hand-computed values on synthetic traces (cluster/bench/metrics.py, records.py)."""

from __future__ import annotations

import pytest

from cluster.bench.metrics import (
    latency_fields,
    parse_percentiles,
    percentile,
    percentile_label,
    summarize_run,
    tpot,
)
from cluster.bench.records import RequestRecord, ServerTimings
from cluster.bench.slo import SloSpec


def trace(
    index: int,
    start: float,
    chunks: list[float],
    end: float,
    prompt_len: int | None = 10,
    output_tokens: int | None = None,
) -> RequestRecord:
    """A successful request: sent at ``start``, chunks at the given times, stream ended at ``end``."""
    return RequestRecord(
        index=index,
        prompt_len=prompt_len,
        max_tokens=len(chunks),
        start=start,
        end=end,
        success=True,
        chunk_times=chunks,
        output_tokens=len(chunks) if output_tokens is None else output_tokens,
    )


def failed(index: int, error: str = "HTTP 500: boom") -> RequestRecord:
    return RequestRecord(index=index, prompt_len=10, max_tokens=4, start=0.0, end=0.5, error=error)


def test_percentile_is_numpy_linear_interpolation() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    # rank h = (n - 1) p / 100 over sorted [1, 2, 3, 4]: p50 -> h=1.5 -> 2.5; p90 -> 2.7 -> 3.7; p99 -> 2.97
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0


def test_percentile_rejects_empty_and_out_of_range() -> None:
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


def test_tpot_formula_and_single_token() -> None:
    assert tpot(1.0, 1.8, 5) == pytest.approx(0.2)  # (1.8 - 1.0) / (5 - 1)
    assert tpot(1.0, 1.0, 1) is None
    assert tpot(1.0, 1.0, 0) is None


def test_record_latencies_from_a_trace() -> None:
    record = trace(0, start=10.0, chunks=[10.5, 10.6, 10.8, 11.1], end=11.2)
    assert record.ttft == pytest.approx(0.5)
    assert record.itls == pytest.approx([0.1, 0.2, 0.3])
    assert record.e2el == pytest.approx(1.2)
    assert record.tpot == pytest.approx((11.1 - 10.5) / 3)


def test_tpot_ends_where_e2el_does_at_a_finish_only_chunk() -> None:
    """A last chunk with a finish reason and no token: E2EL ends there, and so does TPOT, as
    vLLM's (latency - ttft) / (n - 1) (it ended at the last token)."""
    record = trace(0, start=10.0, chunks=[10.5, 10.6, 10.8, 11.1], end=11.4)
    record.last_choice_at = 11.3
    assert record.e2el == pytest.approx(1.3)
    assert record.tpot == pytest.approx((11.3 - 10.5) / 3)


def test_tpot_uses_server_token_count_when_chunks_carry_several_tokens() -> None:
    record = trace(0, start=0.0, chunks=[1.0, 2.0], end=2.0, output_tokens=5)
    assert record.tpot == pytest.approx(0.25)  # (2.0 - 1.0) / (5 - 1)


def test_single_token_request_has_ttft_but_no_tpot_or_itl() -> None:
    record = trace(0, start=0.0, chunks=[0.3], end=0.4)
    assert record.ttft == pytest.approx(0.3)
    assert record.tpot is None
    assert record.itls == []


def test_failed_record_has_no_latencies() -> None:
    record = failed(0)
    assert (record.ttft, record.tpot, record.e2el, record.itls) == (None, None, None, [])


def test_percentile_labels_and_parsing() -> None:
    assert [percentile_label(p) for p in (50.0, 99.0, 99.9)] == ["50", "99", "99.9"]
    assert parse_percentiles("50,90,99.9") == (50.0, 90.0, 99.9)
    with pytest.raises(ValueError, match="'p99'"):
        parse_percentiles("50,p99")
    with pytest.raises(ValueError, match="outside"):
        parse_percentiles("150")


def test_latency_fields_in_ms_and_empty() -> None:
    out = latency_fields("ttft", [0.1, 0.2, 0.3, 0.4], (50.0, 90.0))
    assert out["mean_ttft_ms"] == pytest.approx(250.0)
    assert out["median_ttft_ms"] == pytest.approx(250.0)
    assert out["std_ttft_ms"] == pytest.approx(111.80339887)  # population std of 100,200,300,400
    assert out["p90_ttft_ms"] == pytest.approx(370.0)
    assert latency_fields("tpot", [], (99.0,)) == {
        "mean_tpot_ms": None,
        "median_tpot_ms": None,
        "std_tpot_ms": None,
        "p99_tpot_ms": None,
    }


def test_summarize_run_throughput_and_stats() -> None:
    records = [
        trace(
            0, start=0.0, chunks=[0.1, 0.2, 0.3], end=0.3, prompt_len=10
        ),  # ttft .1, tpot .1, e2e .3
        trace(1, start=0.5, chunks=[0.8], end=0.9, prompt_len=20),  # ttft .3, no tpot, e2e .4
        trace(
            2, start=1.0, chunks=[1.2, 1.5], end=2.0, prompt_len=None
        ),  # ttft .2, tpot .3, e2e 1.0
        failed(3),
    ]
    out = summarize_run(records, duration_s=2.0, percentiles=(50.0, 99.0))
    assert (out["num_prompts"], out["completed"], out["failed"]) == (4, 3, 1)
    assert out["total_input_tokens"] == 30  # unknown prompt length counts 0
    assert out["total_output_tokens"] == 6
    assert out["request_throughput"] == pytest.approx(1.5)
    assert out["output_throughput"] == pytest.approx(3.0)
    assert out["total_token_throughput"] == pytest.approx(18.0)
    assert out["mean_ttft_ms"] == pytest.approx(200.0)
    assert out["p99_ttft_ms"] == pytest.approx(298.0)  # [100, 200, 300]: h = 1.98
    assert out["mean_tpot_ms"] == pytest.approx(
        200.0
    )  # (100 + 300) / 2: the 1-token request is left out
    assert out["median_itl_ms"] == pytest.approx(100.0)  # gaps 100, 100, 300 pooled
    assert out["mean_e2el_ms"] == pytest.approx(1700.0 / 3)
    # One entry per request, in order, as vllm writes them (a failed one: 0, 0.0, [], "").
    assert out["input_lens"] == [10, 20, 0, 10]
    assert out["output_lens"] == [3, 1, 2, 0]
    assert out["ttfts"] == pytest.approx([0.1, 0.3, 0.2, 0.0])
    assert out["tpots"][1:] == [None, pytest.approx(0.3), None]
    assert [len(gaps) for gaps in out["itls"]] == [2, 0, 1, 0]
    assert out["generated_texts"][3] == ""
    assert out["errors"] == ["", "", "", "HTTP 500: boom"]
    assert "request_goodput" not in out
    assert out["num_server_metrics"] == 0 and out["mean_transfer_ms"] is None


def test_summarize_run_goodput_counts_failed_requests_as_missing_slo() -> None:
    records = [
        trace(0, start=0.0, chunks=[0.1, 0.2], end=0.2),  # ttft 100 ms: meets
        trace(1, start=0.0, chunks=[0.3, 0.4], end=0.4),  # ttft 300 ms: misses
        failed(2),
        trace(3, start=0.0, chunks=[0.05], end=0.1),  # meets
    ]
    out = summarize_run(records, duration_s=4.0, slos=SloSpec(ttft_ms=200.0))
    assert out["slo_attainment"] == pytest.approx(0.5)
    assert out["request_goodput"] == pytest.approx(0.5)  # 2 good requests / 4 s


def test_summarize_run_server_timings() -> None:
    a = trace(0, start=0.0, chunks=[0.1], end=0.1)
    a.server = ServerTimings(
        prefill_queue_s=0.01, prefill_s=0.02, transfer_s=0.004, transfer_bytes=1000
    )
    b = trace(1, start=0.0, chunks=[0.1], end=0.1)
    b.server = ServerTimings(
        prefill_queue_s=0.03, prefill_s=0.04, transfer_s=0.002, transfer_bytes=3000
    )
    c = trace(2, start=0.0, chunks=[0.1], end=0.1)  # no server entry
    out = summarize_run([a, b, c], duration_s=1.0)
    assert out["num_server_metrics"] == 2
    assert out["mean_prefill_queue_ms"] == pytest.approx(20.0)
    assert out["mean_prefill_ms"] == pytest.approx(30.0)
    assert out["mean_transfer_ms"] == pytest.approx(3.0)
    assert out["total_transfer_bytes"] == 4000
    assert out["mean_transfer_bytes"] == pytest.approx(2000.0)
    assert out["mean_decode_queue_ms"] is None


def test_summarize_run_prefix_hit_rate_by_medium() -> None:
    records = [trace(i, start=0.0, chunks=[0.1], end=0.1) for i in range(3)]
    records[0].server = ServerTimings(
        prompt_tokens=100, cached_tokens_by_medium={"device": 50}, prefilled_on_decode=False
    )
    records[1].server = ServerTimings(
        prompt_tokens=100,
        cached_tokens_by_medium={"device": 10, "host": 30},
        prefilled_on_decode=True,
    )
    records[2].server = ServerTimings(prefill_s=0.1)  # an entry without the KV fields
    out = summarize_run(records, duration_s=1.0)
    assert out["prefix_hit_rate_device"] == pytest.approx(0.3)
    assert out["prefix_hit_rate_host"] == pytest.approx(0.15)
    assert out["num_prefilled_on_decode"] == 1
    bare = summarize_run([trace(0, start=0.0, chunks=[0.1], end=0.1)], duration_s=1.0)
    assert bare["prefix_hit_rate_host"] is None and bare["num_prefilled_on_decode"] is None


def test_summarize_run_rejects_non_positive_duration() -> None:
    with pytest.raises(ValueError, match="duration"):
        summarize_run([], duration_s=0.0)
