"""docs/benchmarks/cpu_vs_vllm.md from a run of scripts/bench_vs_vllm_cpu.py: the method, the
paired same-run ratios with their spread, the raw medians, the greedy checks and the JSON.

What a person wrote about the figures (which targets are met, corrections, what was tried) sits
between NOTES_BEGIN and NOTES_END on the page: ``render`` places it under the header and
``kept_notes`` reads it back from the page being replaced, so a new run updates the figures
without dropping it. The notes speak of the run they were written for; whoever reruns reads them
again.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

NOTES_BEGIN = "<!-- notes: kept across runs of scripts/bench_vs_vllm_cpu.py; edit by hand -->"
NOTES_END = "<!-- end of notes -->"


def kept_notes(page: Path) -> str:
    """The hand-written notes of an existing page (between the markers), or "" where there are none."""
    if not page.exists():
        return ""
    text = page.read_text()
    begin, end = text.find(NOTES_BEGIN), text.find(NOTES_END)
    if begin < 0 or end < begin:
        return ""
    return text[begin + len(NOTES_BEGIN) : end].strip("\n")


def _ratios(
    rows: list[dict[str, Any]], key: str, num: str, den: str, by: tuple[str, ...]
) -> list[float]:
    """Paired ratios rows[num][key] / rows[den][key] over the rows that agree on ``by``."""
    index = {(r["system"], *(r[b] for b in by)): r[key] for r in rows}
    out = []
    for (system, *rest), value in index.items():
        if system == num and (den, *rest) in index and index[(den, *rest)]:
            out.append(value / index[(den, *rest)])
    return out


def _spread(values: list[float]) -> str:
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.2f}x (1 pair)"
    return f"{statistics.median(values):.2f}x (min {min(values):.2f}, max {max(values):.2f}, {len(values)} pairs)"


def _median_of(rows: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in rows if r.get(key) is not None]
    return f"{statistics.median(values):.2f}" if values else "n/a"


def render(report: dict[str, Any], notes: str = "") -> str:
    meta = report["meta"]
    lines = [
        "# Duet vs vLLM's CPU build on this machine",
        "",
        "Written by `scripts/bench_vs_vllm_cpu.py` (method in its docstring; setup in "
        "`scripts/vllm_cpu_env.py`). Each figure is a paired ratio of two runs of the same "
        "repetition on the same prompts, Duet over the peer; the median over the pairs, with "
        "the smallest and largest pair, says how noisy the machine was.",
        "",
        f"- date: {meta['date']}; machine: {meta['machine']}; load average at start "
        f"{meta['load_start']}, at end {meta.get('load_end', 'n/a')}",
        f"- workload: {meta['num_prompts']} requests x {meta['input_len']} random prompt tokens, "
        f"{meta['output_len']} output tokens (EOS ignored), SmolLM2-135M-Instruct float32, "
        f"{meta['reps']} repetitions",
        f"- vLLM: {meta['vllm']}; Duet servers: {', '.join(meta['duet_configs'])}",
        "",
        "Reading the figures: vLLM's CPU build binds its compute to one core and keeps the other "
        "for its front end (its default on 2 cores); Duet's workers run one torch thread per CPU of "
        "their `resources.num_cpus`. `duet-tN`/`hf-tN` are offline workers with N torch threads "
        "(`duet`/`hf` alone: torch's default, all cores). On a shared host, a process of 2 threads "
        "loses most of its time at OpenMP barriers whenever another process takes a core, so "
        "compare the load averages above before trusting a run.",
        "",
    ]
    lines += [NOTES_BEGIN, *([notes] if notes else []), NOTES_END, ""]
    serving = report["serving"]
    if serving:
        lines += ["## Serving (`duet bench` against each server's URL)", ""]
        lines += [
            "| Duet config | rate (req/s) | request throughput | TPOT median | TTFT median | output tok/s |"
        ]
        lines += ["|---|---|---|---|---|---|"]
        for config in meta["duet_configs"]:
            duet = f"duet:{config}"
            for rate in sorted({r["request_rate"] for r in serving}, key=lambda x: -float(x)):
                rows = [r for r in serving if str(r["request_rate"]) == str(rate)]
                lines.append(
                    f"| {config} | {rate} | "
                    + " | ".join(
                        _spread(_ratios(rows, key, duet, "vllm", ("rep", "seed")))
                        for key in (
                            "request_throughput",
                            "median_tpot_ms",
                            "median_ttft_ms",
                            "output_throughput",
                        )
                    )
                    + " |"
                )
        lines += ["", "Medians of the raw figures (req/s, ms, tok/s):", ""]
        lines += [
            "| system | rate | request throughput | TPOT median | TTFT median | output tok/s | server start s |"
        ]
        lines += ["|---|---|---|---|---|---|---|"]
        for system in sorted({r["system"] for r in serving}):
            for rate in sorted({r["request_rate"] for r in serving}, key=lambda x: -float(x)):
                rows = [
                    r
                    for r in serving
                    if r["system"] == system and str(r["request_rate"]) == str(rate)
                ]
                lines.append(
                    f"| {system} | {rate} | "
                    + " | ".join(
                        _median_of(rows, k)
                        for k in (
                            "request_throughput",
                            "median_tpot_ms",
                            "median_ttft_ms",
                            "output_throughput",
                            "server_start_s",
                        )
                    )
                    + " |"
                )
        lines.append("")
    rows = report["offline"]
    if rows:
        lines += ["## Offline (`LLM.generate` of each, HF batched `generate`)", ""]
        lines += ["| system | output tok/s (median) | Duet / this system |", "|---|---|---|"]
        duets = sorted({r["system"] for r in rows if r["system"].startswith("duet")})
        for system in sorted({r["system"] for r in rows}):
            mine = [r for r in rows if r["system"] == system]
            ratio = "; ".join(
                f"{d}: {_spread(_ratios(rows, 'tok_s', d, system, ('rep',)))}"
                for d in duets
                if d != system
            )
            lines.append(f"| {system} | {_median_of(mine, 'tok_s')} | {ratio or '-'} |")
        lines += [""]
        for eq in _greedy_summary(report):
            lines.append(f"- {eq}")
        lines.append("")
    lines += ["## The JSON of this run", "", "```json", json.dumps(report, indent=1), "```", ""]
    return "\n".join(lines)


def _greedy_summary(report: dict[str, Any]) -> list[str]:
    out = []
    for system in sorted({g["system"] for g in report["greedy_equal_to_hf"]}):
        rows = [g for g in report["greedy_equal_to_hf"] if g["system"] == system]
        out.append(
            f"greedy tokens of {system} equal HF transformers' (up to a first EOS) on "
            f"{sum(g['equal'] for g in rows)} of {sum(g['of'] for g in rows)} requests"
        )
    return out
