"""Arrival schedules: Poisson/gamma gaps, infinite rate, linear ramp-up (cluster/bench/arrivals.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cluster.bench.arrivals import arrival_offsets, warp_ramp_up


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]


def test_infinite_burstiness_is_a_fixed_period() -> None:
    assert arrival_offsets(3, rate=2.0, burstiness=math.inf) == pytest.approx([0.5, 1.0, 1.5])


def test_seeded_and_non_decreasing() -> None:
    a = arrival_offsets(50, rate=5.0, seed=7)
    assert a == arrival_offsets(50, rate=5.0, seed=7)
    assert a != arrival_offsets(50, rate=5.0, seed=8)
    assert all(x <= y for x, y in zip(a, a[1:], strict=False))


@pytest.mark.parametrize("seed", range(4))
def test_the_last_send_falls_at_n_over_r_as_in_vllm(seed: int) -> None:
    """The rate offered is the rate named: the gaps are rescaled so that N requests go out by
    N / R (as drawn, 16 requests at seed 0 took 1.36 N / R); not with a ramp-up (as vLLM)."""
    offsets = arrival_offsets(16, rate=4.0, burstiness=0.5, seed=seed)
    assert offsets[-1] == pytest.approx(16 / 4.0)
    ramped = arrival_offsets(16, rate=4.0, ramp_up_s=2.0, seed=seed)
    assert ramped[-1] != pytest.approx(2.0 + (16 - 4.0) / 4.0)  # (the drawn sum, warped)


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_gap_mean_is_one_over_rate_and_variance_follows_burstiness(burstiness: float) -> None:
    rate, n = 8.0, 40_000
    offsets = np.asarray(arrival_offsets(n, rate, burstiness=burstiness, seed=1))
    gaps = np.diff(np.concatenate([[0.0], offsets]))
    assert gaps.mean() == pytest.approx(1.0 / rate, rel=0.03)
    # gamma with shape k and mean m has a squared coefficient of variation of 1 / k
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1.0 / burstiness, rel=0.06)


def test_ramp_up_warp_by_hand() -> None:
    # rate 2 over a ramp of R = 4 s: L(t) = t^2 / 4 up to t = 4 (4 arrivals expected), then 4 + 2 (t - 4)
    assert warp_ramp_up(1.0, rate=2.0, ramp_up_s=4.0) == pytest.approx(2.0)
    assert warp_ramp_up(4.0, rate=2.0, ramp_up_s=4.0) == pytest.approx(4.0)
    assert warp_ramp_up(6.0, rate=2.0, ramp_up_s=4.0) == pytest.approx(5.0)
    assert warp_ramp_up(6.0, rate=2.0, ramp_up_s=0.0) == pytest.approx(3.0)


def test_ramp_up_schedule_with_regular_gaps() -> None:
    offsets = arrival_offsets(6, rate=2.0, burstiness=math.inf, ramp_up_s=4.0)
    expected = [math.sqrt(4.0 * s) for s in (1, 2, 3, 4)] + [4.5, 5.0]
    assert offsets == pytest.approx(expected)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rate": 0.0}, "rate"),
        ({"rate": 1.0, "burstiness": 0.0}, "burstiness"),
        ({"rate": 1.0, "ramp_up_s": -1.0}, "ramp-up"),
        ({"rate": 1.0, "ramp_up_s": math.inf}, "ramp-up"),  # (it would send nothing, for ever)
    ],
)
def test_invalid_settings(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        arrival_offsets(3, **kwargs)  # type: ignore[arg-type]
