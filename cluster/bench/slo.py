"""Service-level objectives and goodput.

``--goodput ttft:500 tpot:50 e2el:2000`` sets per-request limits in milliseconds. A request meets
them when it succeeded and every given metric is at or below its limit. The attainment of a run is
the fraction of *all* its requests (failed ones included) that met every limit.

Goodput of a rate sweep (``goodput_rate``) is the highest request rate at which at least 90% of the
requests meet every SLO, refined by linear interpolation between swept rates:

1. Sort the swept rates. If none passes (attainment >= 0.9), goodput is 0.
2. Let h be the highest passing rate. If h is the highest swept rate, goodput is h and it is only a
   lower bound (``lower_bound=True``): the sweep never found where attainment drops.
3. Otherwise let n be the next swept rate above h (it fails, since h is the highest passing one).
   If n is infinite, goodput is h. Else goodput is where the straight line through (h, a_h) and
   (n, a_n) crosses 0.9: h + (a_h - 0.9) / (a_h - a_n) * (n - h).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from cluster.bench.records import RequestRecord

SLO_METRICS = ("ttft", "tpot", "e2el")
GOODPUT_ATTAINMENT = 0.9


class SloSpecError(ValueError):
    """A --goodput item that cannot be parsed; the message says which and what is expected."""


@dataclass(frozen=True)
class SloSpec:
    """Per-request latency limits in milliseconds; None = no limit on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def as_dict(self) -> dict[str, float]:
        """The limits that are set, keyed by metric name (``{"ttft": 500.0}``)."""
        out = {m: getattr(self, f"{m}_ms") for m in SLO_METRICS}
        return {k: v for k, v in out.items() if v is not None}


def parse_slos(items: Sequence[str]) -> SloSpec:
    """Parse ["ttft:500", "tpot:50"] into an SloSpec, or raise SloSpecError saying what is wrong."""
    if not items:
        raise SloSpecError("--goodput needs at least one KEY:MS item, e.g. ttft:500")
    limits: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep:
            raise SloSpecError(
                f"bad SLO {item!r}: expected KEY:MS with KEY one of {', '.join(SLO_METRICS)}"
            )
        key = key.strip().lower()
        if key not in SLO_METRICS:
            raise SloSpecError(
                f"bad SLO {item!r}: unknown metric {key!r}, expected one of {', '.join(SLO_METRICS)}"
            )
        if key in limits:
            raise SloSpecError(f"bad SLO {item!r}: {key} is given twice")
        try:
            ms = float(value)
        except ValueError:
            raise SloSpecError(
                f"bad SLO {item!r}: {value!r} is not a number of milliseconds"
            ) from None
        if not (ms > 0.0 and math.isfinite(ms)):
            raise SloSpecError(
                f"bad SLO {item!r}: the limit must be a positive finite number of milliseconds"
            )
        limits[key] = ms
    return SloSpec(**{f"{k}_ms": v for k, v in limits.items()})


def meets(record: RequestRecord, spec: SloSpec) -> bool:
    """Whether one request succeeded and met every limit of ``spec``.

    A request with a single output token has no TPOT, so a TPOT limit does not apply to it.
    """
    if not record.success:
        return False
    for metric in SLO_METRICS:
        limit_ms = getattr(spec, f"{metric}_ms")
        if limit_ms is None:
            continue
        value_s = getattr(record, metric)
        if value_s is None:
            if metric == "tpot" and record.output_tokens < 2:
                continue
            return False
        if value_s * 1000.0 > limit_ms:
            return False
    return True


def attainment(records: Sequence[RequestRecord], spec: SloSpec) -> float:
    """Fraction of ``records`` (failed ones included) that met every SLO; 0.0 for no records."""
    if not records:
        return 0.0
    return sum(1 for r in records if meets(r, spec)) / len(records)


@dataclass(frozen=True)
class Goodput:
    """Goodput of a sweep in requests per second (see the module docstring for the rule)."""

    rate: float
    lower_bound: bool  # True when even the highest swept rate passed


def goodput_rate(
    points: Sequence[tuple[float, float]], threshold: float = GOODPUT_ATTAINMENT
) -> Goodput:
    """Goodput from (request rate, attainment) points; the rule is in the module docstring."""
    if not points:
        raise ValueError("goodput needs at least one (rate, attainment) point")
    ordered = sorted(points)
    passing = [i for i, (_, a) in enumerate(ordered) if a >= threshold]
    if not passing:
        return Goodput(rate=0.0, lower_bound=False)
    h = passing[-1]
    rate_h, att_h = ordered[h]
    if h == len(ordered) - 1:
        return Goodput(rate=rate_h, lower_bound=True)
    rate_n, att_n = ordered[h + 1]
    if math.isinf(rate_n):
        return Goodput(rate=rate_h, lower_bound=False)
    rate = rate_h + (att_h - threshold) / (att_h - att_n) * (rate_n - rate_h)
    return Goodput(rate=rate, lower_bound=False)
