"""ServingMetrics: what /metrics renders, parsed back with prometheus_client's own parser (a
worker's KV cache series: test_kv_cache_metrics.py)."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from cluster.messages import PerfRecord
from cluster.prom_metrics import ServingMetrics
from tests.cluster.conftest import decode_timings, prefill_timings

MODEL = "SmolLM2-135M-Instruct"


def samples(metrics: ServingMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the rendered text, keyed by (name, sorted labels)."""
    text = metrics.render().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(metrics: ServingMetrics, name: str, **labels: str) -> float:
    return samples(metrics)[(name, tuple(sorted({"model_name": MODEL, **labels}.items())))]


def test_observed_request_shows_in_every_histogram_and_counter() -> None:
    metrics = ServingMetrics(MODEL)
    record = PerfRecord("r1", prefill=prefill_timings("r1"), decode=decode_timings("r1"))
    metrics.observe_request(record)
    metrics.observe_request(record)

    assert value(metrics, "duet:time_to_first_token_seconds_count") == 2
    assert value(metrics, "duet:time_to_first_token_seconds_sum") == 1.5
    assert value(metrics, "duet:time_to_first_token_seconds_bucket", le="0.5") == 0
    assert value(metrics, "duet:time_to_first_token_seconds_bucket", le="0.75") == 2
    assert value(metrics, "duet:e2e_request_latency_seconds_sum") == 6.0
    assert value(metrics, "duet:request_time_per_output_token_seconds_sum") == 2 * (2.25 / 4)
    assert value(metrics, "duet:inter_token_latency_seconds_count") == 8
    assert value(metrics, "duet:inter_token_latency_seconds_sum") == 4.5
    assert value(metrics, "duet:request_prefill_time_seconds_sum") == 1.0
    assert value(metrics, "duet:kv_transfer_latency_seconds_sum") == 1.0
    assert value(metrics, "duet:request_queue_time_seconds_sum", role="prefill") == 0.5
    assert value(metrics, "duet:request_queue_time_seconds_sum", role="decode") == 0.25
    assert value(metrics, "duet:request_success_total", finished_reason="length") == 2
    assert value(metrics, "duet:prompt_tokens_total") == 64
    assert value(metrics, "duet:generation_tokens_total") == 10
    assert value(metrics, "duet:kv_transfer_bytes_total") == 8192


def test_time_per_output_token_names_mean_what_they_mean_in_vllm() -> None:
    """vLLM's per-request mean is request_time_per_output_token_seconds; its old
    time_per_output_token_seconds was the inter-token latency (deprecated in 0.11, since removed):
    our per-request mean under that name (as before) was read with vLLM's meaning."""
    metrics = ServingMetrics(MODEL)
    record = PerfRecord("r1", prefill=prefill_timings("r1"), decode=decode_timings("r1"))
    metrics.observe_request(record)
    names = {name for name, _ in samples(metrics)}
    assert not any(name.startswith("duet:time_per_output_token") for name in names)
    assert value(metrics, "duet:request_time_per_output_token_seconds_count") == 1  # per request
    assert value(metrics, "duet:inter_token_latency_seconds_count") == 4  # per gap
    assert value(metrics, "duet:request_time_per_output_token_seconds_sum") == record.tpot_s


def test_aggregated_request_has_no_transfer() -> None:
    metrics = ServingMetrics(MODEL)
    decode = decode_timings(
        "r2",
        arrival_time=10.0,
        prefill_start=10.5,
        prefill_end=11.0,
        first_token_time=11.0,
        transfer_start=None,
        transfer_end=None,
        transfer_bytes=0,
        finish_reason="stop",
    )
    metrics.observe_request(PerfRecord("r2", prefill=None, decode=decode))
    assert value(metrics, "duet:time_to_first_token_seconds_sum") == 1.0
    assert value(metrics, "duet:request_success_total", finished_reason="stop") == 1
    names = {name for name, _ in samples(metrics)}
    assert "duet:kv_transfer_latency_seconds_count" not in names  # never observed
    assert (
        "duet:request_queue_time_seconds_count",
        (("model_name", MODEL), ("role", "prefill")),
    ) not in samples(metrics)


def test_a_transfer_that_moved_nothing_is_no_transfer_latency() -> None:
    """A failed pull (recomputed, or failed): its time is in /perf_metrics, but the transfer
    latency histogram counts transfers (it counted a 1 s deadline as a 1 s transfer)."""
    metrics = ServingMetrics(MODEL)
    failed = dict(transfer_bytes=0, transfer_start=101.0, transfer_end=102.0)
    record = PerfRecord(
        "r3", prefill=prefill_timings("r3", **failed), decode=decode_timings("r3", **failed)
    )
    metrics.observe_request(record)
    assert record.transfer_latency_s == 1.0
    names = {name for name, _ in samples(metrics)}
    assert "duet:kv_transfer_latency_seconds_count" not in names  # never observed
    assert value(metrics, "duet:request_success_total", finished_reason="length") == 1


def test_a_restarted_worker_counts_from_zero_by_its_process_id() -> None:
    """Its totals may have passed the old process's by the next scrape: a new pid says they are
    new (only the difference was added before: 7 after 5 counted 7, not 12)."""
    metrics = ServingMetrics(MODEL)
    d0 = {"role": "decode", "worker": "d0"}
    metrics.set_worker_stats("d0", "decode", 0, 0, 0.0, transfer_failures_total=5, pid=100)
    metrics.set_worker_stats("d0", "decode", 0, 0, 0.0, transfer_failures_total=6, pid=100)
    metrics.set_worker_stats("d0", "decode", 0, 0, 0.0, transfer_failures_total=7, pid=200)
    assert value(metrics, "duet:kv_transfer_failures_total", **d0) == 13


def test_the_routers_retries_and_fallbacks_are_counted() -> None:
    """The latencies count from the attempt that served a request: how many prefills were tried
    again and how many requests D prefilled itself show here."""
    metrics = ServingMetrics(MODEL)
    metrics.set_router_totals(2, 0)
    metrics.set_router_totals(5, 1)
    assert value(metrics, "duet:router_prefill_retries_total") == 5
    assert value(metrics, "duet:router_local_prefill_fallbacks_total") == 1


def test_a_hidden_worker_exports_no_gauges_until_it_reports_again() -> None:
    """A worker that is down (or restarting) shows no last values as current ones; its counters
    keep their totals and count on from there when it is back."""
    metrics = ServingMetrics(MODEL)
    d0 = {"role": "decode", "worker": "d0"}
    metrics.set_worker_stats("d0", "decode", 2, 30, 0.9, transfer_failures_total=3, pid=1)
    metrics.hide_worker("d0", "decode")
    shown = {name for name, labels in samples(metrics) if ("worker", "d0") in labels}
    assert "duet:num_requests_running" not in shown and "duet:kv_cache_usage_perc" not in shown
    assert value(metrics, "duet:kv_transfer_failures_total", **d0) == 3
    metrics.set_worker_stats("d0", "decode", 0, 1, 0.1, transfer_failures_total=4, pid=1)
    assert value(metrics, "duet:num_requests_running", **d0) == 1
    assert value(metrics, "duet:kv_transfer_failures_total", **d0) == 4


def test_worker_gauges_and_running_totals() -> None:
    metrics = ServingMetrics(MODEL)
    metrics.set_worker_stats("p0", "prefill", num_waiting=3, num_running=2, kv_usage=0.25)
    metrics.set_worker_stats(
        "d0", "decode", 1, 7, 0.5, transfer_failures_total=2, expired_leases_total=1,
        transfers_ok_total=40,
    )  # fmt: skip
    metrics.set_worker_stats(
        "d0", "decode", 0, 6, 0.75, transfer_failures_total=5, expired_leases_total=1,
        transfers_ok_total=45,
    )  # fmt: skip
    p0, d0 = {"role": "prefill", "worker": "p0"}, {"role": "decode", "worker": "d0"}
    assert value(metrics, "duet:num_requests_waiting", **p0) == 3
    assert value(metrics, "duet:num_requests_running", **p0) == 2
    assert value(metrics, "duet:kv_cache_usage_perc", **p0) == 0.25
    assert value(metrics, "duet:num_requests_running", **d0) == 6
    assert value(metrics, "duet:kv_cache_usage_perc", **d0) == 0.75
    assert value(metrics, "duet:kv_transfer_failures_total", **d0) == 5
    assert value(metrics, "duet:kv_transfer_expired_leases_total", **d0) == 1
    assert value(metrics, "duet:kv_transfers_ok_total", **d0) == 45
    # A restarted worker reports small totals again: they count from zero.
    metrics.set_worker_stats("d0", "decode", 0, 0, 0.0, transfer_failures_total=1)
    assert value(metrics, "duet:kv_transfer_failures_total", **d0) == 6
    # What became of failed pulls, refused peers, injected faults and wedged UCX messages:
    # running totals alike.
    for total in (3, 4):
        metrics.set_worker_stats(
            "d0",
            "decode",
            0,
            0,
            0.0,
            transfer_recomputed_total=total,
            transfer_failed_requests_total=total - 1,
            refused_peers_total=total + 1,
            injected_faults_total=total + 2,
            wedged_messages_total=total - 2,
            refused_pulls_total=total + 3,
            rejected_messages_total=total + 4,
        )
    assert value(metrics, "duet:kv_transfer_recomputed_total", **d0) == 4
    assert value(metrics, "duet:kv_transfer_failed_requests_total", **d0) == 3
    assert value(metrics, "duet:kv_transfer_refused_peers_total", **d0) == 5
    assert value(metrics, "duet:kv_transfer_injected_faults_total", **d0) == 6
    assert value(metrics, "duet:kv_transfer_wedged_messages_total", **d0) == 2
    assert value(metrics, "duet:kv_transfer_refused_pulls_total", **d0) == 7
    assert value(metrics, "duet:kv_transfer_rejected_messages_total", **d0) == 8

    metrics.remove_worker("p0", "prefill")
    names = {
        name
        for name, labels in samples(metrics)
        if ("worker", "p0") in labels and not name.endswith("_created")
    }
    assert names == {  # counters stay (history); gauges go
        "duet:kv_transfers_ok_total",
        "duet:kv_transfer_failures_total",
        "duet:kv_transfer_expired_leases_total",
        "duet:kv_transfer_recomputed_total",
        "duet:kv_transfer_failed_requests_total",
        "duet:kv_transfer_refused_peers_total",
        "duet:kv_transfer_injected_faults_total",
        "duet:kv_transfer_wedged_messages_total",
        "duet:kv_transfer_refused_pulls_total",
        "duet:kv_transfer_rejected_messages_total",
    }


def test_rejects_usage_outside_zero_one() -> None:
    metrics = ServingMetrics(MODEL)
    with pytest.raises(ValueError, match=r"kv_usage is a fraction in \[0, 1\], got 75.0"):
        metrics.set_worker_stats("d0", "decode", 0, 0, kv_usage=75.0)


def test_registry_is_private() -> None:
    first, second = ServingMetrics(MODEL), ServingMetrics("other")  # no duplicate-name clash
    assert first.registry is not REGISTRY and first.registry is not second.registry
    assert REGISTRY.get_sample_value("duet:prompt_tokens_total", {"model_name": MODEL}) is None
    assert first.content_type.startswith("text/plain")
