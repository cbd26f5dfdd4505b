"""PNG plots of a results document: latency CDFs, TTFT/TPOT against rate, SLO attainment and goodput
against rate, and the disaggregated-vs-aggregated comparison. matplotlib (the `bench` extra) is
imported only here, lazily, with the Agg backend so no display is needed."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cluster.bench.metrics import percentile_label


def rate_positions(rates: Sequence[float]) -> tuple[list[float], list[str]]:
    """x positions and tick labels of swept rates; an infinite rate sits at 1.5x the largest finite."""
    finite = [r for r in rates if math.isfinite(r)]
    inf_at = max(finite) * 1.5 if finite else 1.0
    return [r if math.isfinite(r) else inf_at for r in rates], [
        f"{r:g}" if math.isfinite(r) else "inf" for r in rates
    ]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _rates(entry: dict[str, Any]) -> list[float]:
    return [float(run["request_rate"]) for run in entry["runs"]]


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return path


def plot_latency_cdfs(doc: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title in zip(
        axes, ("ttfts", "tpots", "e2els"), ("TTFT", "TPOT", "E2E latency"), strict=True
    ):
        for entry in doc["targets"]:
            for run in entry["runs"]:
                values = sorted(  # (the successful requests': a failed one has none)
                    1000.0 * v
                    for v, error in zip(run[key], run["errors"], strict=True)
                    if not error and v is not None
                )
                if values:
                    ys = [(i + 1) / len(values) for i in range(len(values))]
                    ax.step(
                        values,
                        ys,
                        where="post",
                        label=f"{entry['label']} @ {float(run['request_rate']):g}/s",
                    )
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:  # a run where every request failed has no curve
        axes[0].legend(fontsize="small")
    return _save(fig, path)


def plot_latency_vs_rate(doc: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    tail = percentile_label(max(doc["percentiles"])) if doc["percentiles"] else "50"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
        for entry in doc["targets"]:
            xs, labels = rate_positions(_rates(entry))
            for stat, style in (("median", "-o"), (f"p{tail}", "--x")):
                ys = [run[f"{stat}_{metric}_ms"] for run in entry["runs"]]
                ax.plot(
                    xs,
                    [math.nan if y is None else y for y in ys],
                    style,
                    label=f"{entry['label']} {stat}",
                )
            ax.set_xticks(xs, labels)
        ax.set(
            title=f"{metric.upper()} against request rate",
            xlabel="request rate (req/s)",
            ylabel="ms",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _save(fig, path)


def plot_goodput(doc: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for entry in doc["targets"]:
        xs, labels = rate_positions(_rates(entry))
        line = ax.plot(
            xs, [100.0 * run["slo_attainment"] for run in entry["runs"]], "-o", label=entry["label"]
        )[0]
        ax.set_xticks(xs, labels)
        if "goodput" in entry and 0.0 < float(entry["goodput"]) < math.inf:
            ax.axvline(
                float(entry["goodput"]),
                color=line.get_color(),
                linestyle=":",
                label=f"{entry['label']} goodput {float(entry['goodput']):.2f}/s",
            )
    ax.axhline(90.0, color="grey", linestyle="--", linewidth=1)
    ax.set(
        title="SLO attainment and goodput",
        xlabel="request rate (req/s)",
        ylabel="% requests meeting all SLOs",
        ylim=(0, 102),
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def plot_comparison(doc: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    first, second = doc["targets"][0], doc["targets"][1]
    rates = [r for r in _rates(first) if r in set(_rates(second))]
    by_rate = [{float(run["request_rate"]): run for run in e["runs"]} for e in (first, second)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    metrics = (
        ("output_throughput", "output tokens/s"),
        ("median_ttft_ms", "TTFT median ms"),
        ("median_tpot_ms", "TPOT median ms"),
    )
    width = 0.38
    for ax, (key, title) in zip(axes, metrics, strict=True):
        for k, (entry, runs) in enumerate(zip((first, second), by_rate, strict=True)):
            # (a run without the figure has no bar, not a 0 that reads as the best)
            ys = [runs[r][key] if runs[r][key] is not None else math.nan for r in rates]
            ax.bar(
                [i + (k - 0.5) * width for i in range(len(rates))], ys, width, label=entry["label"]
            )
        ax.set_xticks(range(len(rates)), [f"{r:g}" if math.isfinite(r) else "inf" for r in rates])
        ax.set(title=title, xlabel="request rate (req/s)")
        ax.legend(fontsize="small")
    fig.suptitle(f"{first['label']} vs {second['label']}")
    return _save(fig, path)


def write_plots(doc: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write every plot that the document has data for into ``out_dir``; returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    targets = [e for e in doc["targets"] if e["runs"]]
    if not targets:
        return []
    doc = {**doc, "targets": targets}
    written = [
        plot_latency_cdfs(doc, out / "latency_cdf.png"),
        plot_latency_vs_rate(doc, out / "latency_vs_rate.png"),
    ]
    if all("slo_attainment" in run for e in targets for run in e["runs"]):
        written.append(plot_goodput(doc, out / "goodput_vs_rate.png"))
    if len(targets) >= 2:
        written.append(plot_comparison(doc, out / "disagg_vs_agg.png"))
    return written
