"""The sweep's own rules (cluster/bench/sweep.py): no goodput rate under a concurrency cap, a
ramp-up or chained turns, and a warm-up prompt that shares no prefix with a measured one."""

from __future__ import annotations

from cluster.bench.sweep import _unshared, update_goodput


def test_a_capped_sweep_gets_no_goodput_rate() -> None:
    """Under --max-concurrency a request waits for a slot outside its latencies: every rate can
    pass while the server receives far less, so no rate is named (each run keeps its own)."""
    runs = [{"request_rate": r, "slo_attainment": 1.0, "max_concurrency": None} for r in (5, 80)]
    free = {"runs": runs}
    update_goodput(free)
    assert (free["goodput"], free["goodput_is_lower_bound"]) == (80, True)
    capped = {"runs": [{**run, "max_concurrency": 1} for run in runs]}
    update_goodput(capped)
    assert "goodput" not in capped


def test_a_sweep_that_does_not_send_at_its_rates_gets_no_goodput_rate() -> None:
    """With a ramp-up the sends are neither at the rate nor rescaled to it (R = 4 over a 4 s ramp,
    16 requests: about 2 req/s offered), and a conversation's later turn waits for the turn
    before: the rate a run names is not what the server got, so no goodput rate is named."""
    runs = [{"request_rate": r, "slo_attainment": 1.0, "max_concurrency": None} for r in (2, 4)]
    ramped = {"runs": [{**run, "ramp_up_seconds": 4.0} for run in runs]}
    update_goodput(ramped)
    assert "goodput" not in ramped
    conversations = {"runs": runs}
    update_goodput(conversations, chained=True)
    assert "goodput" not in conversations


def test_the_warm_up_prompt_starts_otherwise_and_is_about_as_long() -> None:
    """(A reversed text tokenizes to far more tokens than its prompt: a first prompt near
    max_model_len made the warm-up fail.)"""
    assert _unshared([1, 2, 3]) == [3, 2, 1]
    assert _unshared("The capital of France") == "capital of France The"
    assert _unshared("one") == "one"
