"""The terminal report: one table per target, server timings, goodput, and the side-by-side
comparison of the disaggregated and aggregated runs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from cluster.bench.kv_tier_counters import HOST_COUNTERS
from cluster.bench.metrics import percentile_label

# (column title, field of a run) compared side by side; "p{tail}" is the highest percentile asked for.
_COMPARED = (
    ("req/s", "request_throughput"),
    ("out tok/s", "output_throughput"),
    ("TTFT median ms", "median_ttft_ms"),
    ("TTFT p{tail} ms", "p{tail}_ttft_ms"),
    ("TPOT median ms", "median_tpot_ms"),
    ("TPOT p{tail} ms", "p{tail}_tpot_ms"),
    ("E2E p{tail} ms", "p{tail}_e2el_ms"),
)


def fmt(value: Any, digits: int = 1) -> str:
    """A number for a table cell: "-" for missing, "inf" for infinity."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf"
        return f"{value:.{digits}f}"
    return str(value)


def fmt_rate(rate: Any) -> str:
    """A request rate: "0.5", "200", "inf"; "-" for a row that is not per rate."""
    return "-" if rate is None else f"{float(rate):g}"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """Columns padded to their widest cell: the first ``left`` left-aligned, the others right-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]
    lines = []
    for row in (headers, *rows):
        cells = [
            str(c).ljust(w) if i < left else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _tail(percentiles: Sequence[float]) -> str:
    return percentile_label(max(percentiles)) if percentiles else "50"


def target_table(entry: dict[str, Any], tail: str, with_slo: bool) -> str:
    headers = [
        "rate",
        "ok",
        "failed",
        "req/s",
        "out tok/s",
        "TTFT med ms",
        f"TTFT p{tail} ms",
        "TPOT med ms",
        f"TPOT p{tail} ms",
        f"ITL p{tail} ms",
        f"E2E p{tail} ms",
    ]
    if with_slo:
        headers += ["SLO met", "good req/s"]
    rows = []
    for run in entry["runs"]:
        row = [fmt_rate(run["request_rate"]), fmt(run["completed"]), fmt(run["failed"])]
        row += [fmt(run["request_throughput"], 2), fmt(run["output_throughput"])]
        row += [
            fmt(run[k])
            for k in ("median_ttft_ms", f"p{tail}_ttft_ms", "median_tpot_ms", f"p{tail}_tpot_ms")
        ]
        row += [fmt(run[f"p{tail}_itl_ms"]), fmt(run[f"p{tail}_e2el_ms"])]
        if with_slo:
            row += [f"{100.0 * run['slo_attainment']:.0f}%", fmt(run["request_goodput"], 2)]
        rows.append(row)
    return format_table(headers, rows)


def server_table(entry: dict[str, Any]) -> str | None:
    """Mean Duet /perf_metrics timings per rate, or None when the target reported none."""
    runs = [r for r in entry["runs"] if r.get("num_server_metrics")]
    if not runs:
        return None
    headers = [
        "rate",
        "requests",
        "prefill queue ms",
        "prefill ms",
        "transfer ms",
        "transfer KiB",
        "decode queue ms",
        "hit device %",
        "hit host %",
        "prefilled on D",
    ]
    rows = []
    for run in runs:
        kib = (
            run["mean_transfer_bytes"] / 1024.0 if run["mean_transfer_bytes"] is not None else None
        )
        rows.append(
            [
                fmt_rate(run["request_rate"]),
                fmt(run["num_server_metrics"]),
                fmt(run["mean_prefill_queue_ms"], 2),
                fmt(run["mean_prefill_ms"], 2),
                fmt(run["mean_transfer_ms"], 2),
                fmt(kib),
                fmt(run["mean_decode_queue_ms"], 2),
                _percent(run.get("prefix_hit_rate_device")),
                _percent(run.get("prefix_hit_rate_host")),
                fmt(run.get("num_prefilled_on_decode")),
            ]
        )
    return format_table(headers, rows)


def kv_tier_table(entry: dict[str, Any]) -> str | None:
    """The KV host tiers' counters over each run (summed over workers and pool groups), or None
    when the target has no host tier (cluster/bench/kv_tier_counters.py)."""
    runs = [r for r in entry["runs"] if "kv_host_offloaded_pages" in r]
    if not runs:
        return None
    keys = list(HOST_COUNTERS)
    headers = [
        "rate",
        "offloaded",
        "loaded back",
        "host hit tokens",
        "host drops",
        "skipped stores",
    ]
    rows = [[fmt_rate(r["request_rate"]), *(fmt(r[f"kv_host_{k}"]) for k in keys)] for r in runs]
    return format_table(headers, rows)


def _percent(rate: float | None) -> str:
    return fmt(None if rate is None else 100.0 * rate, 1)


def comparison_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per rate run by both targets: each compared metric for both and their ratio (first / second)."""
    if len(doc["targets"]) < 2:
        return []
    first, second = doc["targets"][0], doc["targets"][1]
    tail = _tail(doc["percentiles"])
    theirs = {run["request_rate"]: run for run in second["runs"]}
    rows = []
    for run in first["runs"]:
        other = theirs.get(run["request_rate"])
        if other is None:
            continue
        for title, key in _COMPARED:
            key = key.format(tail=tail)
            a, b = run.get(key), other.get(key)
            ratio = a / b if a is not None and b not in (None, 0) else None
            rows.append(
                {
                    "request_rate": run["request_rate"],
                    "metric": title.format(tail=tail),
                    "key": key,
                    first["label"]: a,
                    second["label"]: b,
                    "ratio": ratio,
                }
            )
    if "goodput" in first and "goodput" in second:
        a, b = float(first["goodput"]), float(second["goodput"])
        bound = first["goodput_is_lower_bound"] or second["goodput_is_lower_bound"]
        # (no ratio of a lower bound: every swept rate met the SLOs, the goodput may be far higher)
        ratio = a / b if b != 0.0 and math.isfinite(a + b) and not bound else None
        rows.append(
            {
                "request_rate": None,
                "metric": "goodput req/s" + (" (a lower bound)" if bound else ""),
                "key": "goodput",
                first["label"]: a,
                second["label"]: b,
                "ratio": ratio,
            }
        )
    return rows


def render_report(doc: dict[str, Any]) -> str:
    """The whole terminal report of a results document (complete or partial)."""
    tail = _tail(doc["percentiles"])
    slos = doc.get("goodput_slos") or {}
    parts = []
    for entry in doc["targets"]:
        title = f"== {entry['label']}  ({entry.get('url') or 'not started'}, model {entry.get('model_id', '?')}) =="
        parts += (
            [title, target_table(entry, tail, bool(slos))]
            if entry["runs"]
            else [title, "(no completed run)"]
        )
        server = server_table(entry)
        if server:
            parts += ["Duet server timings (means, from /perf_metrics):", server]
        tier = kv_tier_table(entry)
        if tier:
            parts += ["KV host tiers over each run (pages, tokens; from /metrics):", tier]
        if slos and entry["runs"] and "goodput" not in entry:
            parts.append(
                "goodput: no rate under --max-concurrency (requests wait for a slot outside "
                "their latencies); each run's good req/s is in the table"
            )
        if "goodput" in entry:
            limits = ", ".join(f"{k} <= {v:g} ms" for k, v in slos.items())
            bound = (
                " (lower bound: every swept rate met the SLOs)"
                if entry["goodput_is_lower_bound"]
                else ""
            )
            if math.isinf(float(entry["goodput"])):  # (a rate says nothing of that)
                parts.append(
                    f"goodput: >= 90% of requests met {limits} even with every request sent at "
                    "once (rate inf), so any rate of this many requests does; each run's good "
                    "req/s is in the table"
                )
            else:
                parts.append(
                    f"goodput: {fmt(float(entry['goodput']), 2)} req/s with >= 90% of requests "
                    f"at {limits}{bound}"
                )
        parts.append("")
    rows = comparison_rows(doc)
    if rows:
        a, b = doc["targets"][0]["label"], doc["targets"][1]["label"]
        parts.append(f"== {a} vs {b} (ratio = {a} / {b}) ==")
        table, shown = [], object()
        for r in rows:  # the rate only on the first row of its group
            rate = fmt_rate(r["request_rate"]) if r["request_rate"] != shown else ""
            shown = r["request_rate"]
            table.append([rate, r["metric"], fmt(r[a], 2), fmt(r[b], 2), fmt(r["ratio"], 2)])
        parts += [format_table(["rate", "metric", a, b, "ratio"], table, left=2), ""]
    if doc.get("error"):
        parts.append(f"ERROR: {doc['error']}")
    return "\n".join(parts).rstrip() + "\n"
