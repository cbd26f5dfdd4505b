"""Terminal report, comparison rows, JSON results file and plots (report.py, results_file.py, plots.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from cluster.bench.plots import rate_positions, write_plots
from cluster.bench.report import comparison_rows, fmt, format_table, render_report
from cluster.bench.results_file import to_jsonable, write_results


def run(rate: float, scale: float, attainment: float | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "request_rate": rate,
        "completed": 4,
        "failed": 0,
        "request_throughput": 2.0 * scale,
        "output_throughput": 20.0 * scale,
        "num_server_metrics": 0,
        "ttfts": [0.1, 0.2, 0.0],
        "tpots": [0.01, 0.02, None],
        "e2els": [0.3, 0.4, None],
        "errors": ["", "", "HTTP 500: boom"],  # (a failed request: no point on a curve)
    }
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p50", "p99"):
            out[f"{stat}_{metric}_ms"] = 10.0 / scale
    if attainment is not None:
        out["slo_attainment"] = attainment
        out["request_goodput"] = attainment * out["request_throughput"]
    return out


def doc(slo: bool = False) -> dict[str, Any]:
    att = (1.0, 0.5) if slo else (None, None)
    targets = [
        {
            "label": "disaggregated",
            "url": "http://a",
            "model_id": "m",
            "runs": [run(1.0, 2.0, att[0]), run(math.inf, 2.0, att[1])],
        },
        {
            "label": "aggregated",
            "url": "http://b",
            "model_id": "m",
            "runs": [run(1.0, 1.0, att[0])],
        },
    ]
    if slo:
        for t in targets:
            t["goodput"], t["goodput_is_lower_bound"] = 1.0, False
    return {
        "percentiles": [50.0, 99.0],
        "goodput_slos": {"ttft": 100.0} if slo else None,
        "targets": targets,
        "error": None,
    }


def test_format_table_aligns_columns() -> None:
    assert (
        format_table(["a", "bb"], [["x", "1"], ["yyy", "22"]])
        == "a    bb\n---  --\nx     1\nyyy  22"
    )
    assert format_table(["a", "b"], [["x", "y"]], left=2) == "a  b\n-  -\nx  y"
    assert (fmt(None), fmt(math.inf), fmt(1.234, 2), fmt(3)) == ("-", "inf", "1.23", "3")


def test_comparison_rows_pair_runs_of_the_same_rate() -> None:
    rows = comparison_rows(doc())
    assert {r["request_rate"] for r in rows} == {1.0}  # inf ran on one target only
    by_key = {r["key"]: r for r in rows}
    assert by_key["output_throughput"]["disaggregated"] == 40.0
    assert by_key["output_throughput"]["aggregated"] == 20.0
    assert by_key["output_throughput"]["ratio"] == 2.0
    assert by_key["p99_ttft_ms"]["ratio"] == 0.5
    assert comparison_rows({**doc(), "targets": doc()["targets"][:1]}) == []
    goodput = comparison_rows(doc(slo=True))[-1]
    assert (goodput["request_rate"], goodput["metric"], goodput["ratio"]) == (
        None,
        "goodput req/s",
        1.0,
    )


def test_render_report_shows_targets_goodput_comparison_and_error() -> None:
    text = render_report({**doc(slo=True), "error": "boom"})
    assert "== disaggregated  (http://a, model m) ==" in text
    assert "goodput: 1.00 req/s with >= 90% of requests at ttft <= 100 ms" in text
    assert "== disaggregated vs aggregated (ratio = disaggregated / aggregated) ==" in text
    assert "100%" in text and "50%" in text
    assert text.rstrip().endswith("ERROR: boom")


def test_a_capped_sweep_names_no_goodput_rate_and_a_bound_gives_no_ratio() -> None:
    capped = doc(slo=True)
    for t in capped["targets"]:
        del t["goodput"], t["goodput_is_lower_bound"]
    text = render_report(capped)
    assert text.count("goodput: no rate under --max-concurrency") == 2
    assert "good req/s" in text and "2.00" in text  # the runs' own goodput
    bounded = doc(slo=True)
    bounded["targets"][0]["goodput_is_lower_bound"] = True
    row = comparison_rows(bounded)[-1]
    assert (row["metric"], row["ratio"]) == ("goodput req/s (a lower bound)", None)


def test_a_goodput_at_rate_inf_is_said_in_words() -> None:
    """Every request sent at once met the SLOs (the default rate inf): "inf req/s" told
    nothing; the report says what it means."""
    at_once = doc(slo=True)
    at_once["targets"][0]["goodput"] = math.inf
    at_once["targets"][0]["goodput_is_lower_bound"] = True
    text = render_report(at_once)
    assert "even with every request sent at once (rate inf)" in text
    assert "inf req/s" not in text


def test_results_file_roundtrip_with_infinity(tmp_path: Path) -> None:
    assert to_jsonable({"r": [math.inf, -math.inf, 1.5], "t": (math.nan,)}) == {
        "r": ["inf", "-inf", 1.5],
        "t": ["nan"],
    }
    path = write_results(tmp_path / "sub" / "results.json", {"request_rate": math.inf})
    assert json.loads(path.read_text()) == {"request_rate": "inf"}
    assert [p.name for p in path.parent.iterdir()] == ["results.json"]  # no temporary file left


def test_rate_positions_put_infinity_past_the_largest_rate() -> None:
    assert rate_positions([1.0, 4.0, math.inf]) == ([1.0, 4.0, 6.0], ["1", "4", "inf"])
    assert rate_positions([math.inf]) == ([1.0], ["inf"])


def test_write_plots(tmp_path: Path) -> None:
    written = write_plots(doc(slo=True), tmp_path)
    names = sorted(p.name for p in written)
    assert names == [
        "disagg_vs_agg.png",
        "goodput_vs_rate.png",
        "latency_cdf.png",
        "latency_vs_rate.png",
    ]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in write_plots(doc(), tmp_path / "plain")) == [
        "disagg_vs_agg.png",
        "latency_cdf.png",
        "latency_vs_rate.png",
    ]


def test_a_comparison_bar_without_its_figure_is_left_out_not_drawn_as_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run with no TPOT (every request one token) has no bar: a 0 ms bar read as the best."""
    import matplotlib.axes

    from cluster.bench.plots import plot_comparison

    heights: list[float] = []
    real_bar = matplotlib.axes.Axes.bar

    def bar(self: matplotlib.axes.Axes, x: Any, height: Any, *args: Any, **kwargs: Any) -> Any:
        heights.extend(height)  # (what each bar was asked to be)
        return real_bar(self, x, height, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "bar", bar)
    d = doc()
    d["targets"][1]["runs"][0]["median_tpot_ms"] = None
    plot_comparison(d, tmp_path / "cmp.png")
    assert (tmp_path / "cmp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 0.0 not in heights and sum(math.isnan(h) for h in heights) == 1
