"""ServingMetrics: what /metrics renders, parsed back with prometheus_client's own parser."""

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
    assert value(metrics, "duet:time_per_output_token_seconds_sum") == 2 * (2.25 / 4)
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


def test_worker_gauges_and_running_totals() -> None:
    metrics = ServingMetrics(MODEL)
    metrics.set_worker_stats("p0", "prefill", num_waiting=3, num_running=2, kv_usage=0.25)
    metrics.set_worker_stats(
        "d0", "decode", 1, 7, 0.5, transfer_failures_total=2, expired_leases_total=1
    )
    metrics.set_worker_stats(
        "d0", "decode", 0, 6, 0.75, transfer_failures_total=5, expired_leases_total=1
    )
    p0, d0 = {"role": "prefill", "worker": "p0"}, {"role": "decode", "worker": "d0"}
    assert value(metrics, "duet:num_requests_waiting", **p0) == 3
    assert value(metrics, "duet:num_requests_running", **p0) == 2
    assert value(metrics, "duet:kv_cache_usage_perc", **p0) == 0.25
    assert value(metrics, "duet:num_requests_running", **d0) == 6
    assert value(metrics, "duet:kv_cache_usage_perc", **d0) == 0.75
    assert value(metrics, "duet:kv_transfer_failures_total", **d0) == 5
    assert value(metrics, "duet:kv_transfer_expired_leases_total", **d0) == 1
    # A restarted worker reports small totals again: they count from zero.
    metrics.set_worker_stats("d0", "decode", 0, 0, 0.0, transfer_failures_total=1)
    assert value(metrics, "duet:kv_transfer_failures_total", **d0) == 6
    # What became of failed pulls, refused peers and injected faults: running totals alike.
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
        )
    assert value(metrics, "duet:kv_transfer_recomputed_total", **d0) == 4
    assert value(metrics, "duet:kv_transfer_failed_requests_total", **d0) == 3
    assert value(metrics, "duet:kv_transfer_refused_peers_total", **d0) == 5
    assert value(metrics, "duet:kv_transfer_injected_faults_total", **d0) == 6

    metrics.remove_worker("p0", "prefill")
    names = {
        name
        for name, labels in samples(metrics)
        if ("worker", "p0") in labels and not name.endswith("_created")
    }
    assert names == {  # counters stay (history); gauges go
        "duet:kv_transfer_failures_total",
        "duet:kv_transfer_expired_leases_total",
        "duet:kv_transfer_recomputed_total",
        "duet:kv_transfer_failed_requests_total",
        "duet:kv_transfer_refused_peers_total",
        "duet:kv_transfer_injected_faults_total",
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
