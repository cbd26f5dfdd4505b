"""When each request is sent: Poisson or gamma inter-arrival times, with an optional linear ramp-up.

The schedule is a pure function of its arguments (seeded), so a sweep sends the same pattern on every
target it compares.

Model. Inter-arrival gaps are gamma distributed with shape ``burstiness`` and mean ``1 / rate``:
burstiness 1 is a Poisson process, below 1 burstier, above 1 more regular (infinity = a fixed period).
With ``ramp_up_s`` > 0 the instantaneous rate grows linearly from 0 to ``rate`` over the first
``ramp_up_s`` seconds and stays at ``rate`` afterwards. This is done by time warping: the gaps are
drawn for a unit-rate process, their running sums s_i are the expected number of arrivals by the
i-th send, and the send time is t_i = L^-1(s_i) where L(t) = integral of the rate up to t:
  L(t) = rate * t^2 / (2 R)           for t <= R   ->  t = sqrt(2 R s / rate)
  L(t) = rate * R / 2 + rate (t - R)  for t >= R   ->  t = R + (s - rate R / 2) / rate
"""

from __future__ import annotations

import math

import numpy as np


def warp_ramp_up(expected_arrivals: float, rate: float, ramp_up_s: float) -> float:
    """The time by which a linear ramp from 0 to ``rate`` over ``ramp_up_s`` expects that many arrivals."""
    if ramp_up_s <= 0.0:
        return expected_arrivals / rate
    during_ramp = rate * ramp_up_s / 2.0
    if expected_arrivals <= during_ramp:
        return math.sqrt(2.0 * ramp_up_s * expected_arrivals / rate)
    return ramp_up_s + (expected_arrivals - during_ramp) / rate


def arrival_offsets(
    num_requests: int,
    rate: float,
    burstiness: float = 1.0,
    ramp_up_s: float = 0.0,
    seed: int = 0,
) -> list[float]:
    """Send times in seconds from the start of the run, non-decreasing, one per request.

    ``rate`` is requests per second; ``math.inf`` sends every request at once (offset 0). The first
    request goes out after one gap, not at 0, as a Poisson process would send it. Without a
    ramp-up the last one goes out at ``num_requests / rate`` (vLLM's rescaling of the gaps).
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not rate > 0.0:
        raise ValueError(f"request rate must be positive (or inf), got {rate}")
    if not burstiness > 0.0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if not 0.0 <= ramp_up_s < math.inf:  # (an endless ramp-up would send nothing, for ever)
        raise ValueError(f"ramp-up must be a finite number of seconds >= 0, got {ramp_up_s}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    if math.isinf(burstiness):
        gaps = np.ones(num_requests)
    else:
        # shape k, scale 1/k: mean 1, variance 1/k (a unit-rate process; the rate comes from warping)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / burstiness, size=num_requests)
    expected = np.cumsum(gaps)
    if ramp_up_s == 0.0:
        # As vLLM's: the sums rescaled so that the last send falls at N / R. As drawn, a run of N
        # requests offers a rate off by about 1/sqrt(N) (a fixed seed: the same way at every
        # rate; 0.74x at N = 16, seed 0), and its throughputs with it.
        expected *= num_requests / expected[-1] if num_requests else 1.0
    return [warp_ramp_up(float(s), rate, ramp_up_s) for s in expected]
