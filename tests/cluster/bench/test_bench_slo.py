"""SLO parsing, per-request SLO checks and the goodput interpolation rule (cluster/bench/slo.py)."""

from __future__ import annotations

import math

import pytest

from cluster.bench.records import RequestRecord
from cluster.bench.slo import (
    Goodput,
    SloSpec,
    SloSpecError,
    attainment,
    goodput_rate,
    meets,
    parse_slos,
)


def record(ttft: float, tokens: int, gap: float, ok: bool = True) -> RequestRecord:
    """A request sent at 0 with its first chunk at ``ttft`` and one chunk every ``gap`` after."""
    chunks = [ttft + i * gap for i in range(tokens)]
    return RequestRecord(
        index=0,
        prompt_len=4,
        max_tokens=tokens,
        start=0.0,
        end=chunks[-1] if chunks else 0.0,
        success=ok,
        chunk_times=chunks,
        output_tokens=tokens,
        error="" if ok else "x",
    )


def test_parse_slos() -> None:
    assert parse_slos(["ttft:500", "TPOT:50.5"]) == SloSpec(ttft_ms=500.0, tpot_ms=50.5)
    assert parse_slos(["e2el:2000"]).as_dict() == {"e2el": 2000.0}


@pytest.mark.parametrize(
    ("items", "message"),
    [
        ([], "at least one"),
        (["ttft500"], "expected KEY:MS"),
        (["itl:5"], "unknown metric 'itl'"),
        (["ttft:fast"], "'fast' is not a number"),
        (["ttft:-1"], "positive"),
        (["ttft:inf"], "positive finite"),
        (["ttft:5", "ttft:6"], "given twice"),
    ],
)
def test_parse_slos_errors(items: list[str], message: str) -> None:
    with pytest.raises(SloSpecError, match=message):
        parse_slos(items)


def test_meets_each_limit_inclusive() -> None:
    spec = SloSpec(ttft_ms=200.0, tpot_ms=50.0, e2el_ms=400.0)
    assert meets(
        record(ttft=0.2, tokens=5, gap=0.05), spec
    )  # ttft 200, tpot 50, e2el 400: all at the limit
    assert not meets(record(ttft=0.21, tokens=5, gap=0.05), spec)  # ttft over
    assert not meets(record(ttft=0.1, tokens=5, gap=0.06), spec)  # tpot 60 over
    assert not meets(record(ttft=0.1, tokens=2, gap=0.05, ok=False), spec)  # failed never meets


def test_tpot_slo_does_not_apply_to_single_token_output() -> None:
    assert meets(record(ttft=0.1, tokens=1, gap=0.0), SloSpec(tpot_ms=1.0))


def test_attainment_counts_all_requests() -> None:
    spec = SloSpec(ttft_ms=100.0)
    records = [
        record(0.05, 2, 0.01),
        record(0.5, 2, 0.01),
        record(0.05, 2, 0.01, ok=False),
        record(0.1, 1, 0.0),
    ]
    assert attainment(records, spec) == pytest.approx(0.5)
    assert attainment([], spec) == 0.0


def test_goodput_interpolates_between_last_passing_and_first_failing() -> None:
    # h = 2 (0.95), n = 4 (0.5): 2 + (0.95 - 0.9) / (0.95 - 0.5) * (4 - 2) = 2.2222...
    result = goodput_rate([(4.0, 0.5), (1.0, 1.0), (2.0, 0.95)])  # any order
    assert result.rate == pytest.approx(2.0 + 0.05 / 0.45 * 2.0)
    assert not result.lower_bound


def test_goodput_exactly_at_threshold_passes() -> None:
    assert goodput_rate([(1.0, 0.9), (3.0, 0.5)]) == Goodput(rate=1.0, lower_bound=False)


def test_goodput_all_rates_pass_is_a_lower_bound() -> None:
    assert goodput_rate([(1.0, 1.0), (2.0, 0.92)]) == Goodput(rate=2.0, lower_bound=True)
    inf = goodput_rate([(1.0, 1.0), (math.inf, 0.95)])
    assert math.isinf(inf.rate) and inf.lower_bound


def test_goodput_none_pass_is_zero() -> None:
    assert goodput_rate([(1.0, 0.89), (2.0, 0.1)]) == Goodput(rate=0.0, lower_bound=False)


def test_goodput_next_rate_infinite_gives_last_passing() -> None:
    assert goodput_rate([(1.0, 1.0), (2.0, 0.95), (math.inf, 0.2)]) == Goodput(
        rate=2.0, lower_bound=False
    )


def test_goodput_uses_highest_passing_rate_when_attainment_is_not_monotone() -> None:
    # passes at 1 and 4, fails at 2: h = 4, n = 8 -> 4 + (0.95 - 0.9) / (0.95 - 0.7) * 4 = 4.8
    result = goodput_rate([(1.0, 1.0), (2.0, 0.8), (4.0, 0.95), (8.0, 0.7)])
    assert result.rate == pytest.approx(4.8)


def test_goodput_needs_points() -> None:
    with pytest.raises(ValueError, match="at least one"):
        goodput_rate([])
