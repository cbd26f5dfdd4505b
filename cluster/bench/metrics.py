"""Statistics of one benchmark run: percentiles, TPOT, latency summaries, throughput.

Field names follow `vllm bench serve` where the two overlap (``mean_ttft_ms``, ``p99_itl_ms``,
``request_throughput``, ...), so the JSON of either tool can be read by the same scripts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from cluster.bench.records import RequestRecord
    from cluster.bench.slo import SloSpec

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0 <= p <= 100) by linear interpolation between closest ranks.

    This is numpy's default method ("linear", Hyndman & Fan type 7): with the values sorted as
    x[0..n-1], the rank is h = (n - 1) * p / 100 and the result x[floor h] + (h - floor h) *
    (x[floor h + 1] - x[floor h]). Example: [1, 2, 3, 4] gives p50 = 2.5, p90 = 3.7, p99 = 3.97.
    """
    if len(values) == 0:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be within [0, 100], got {p}")
    return float(np.percentile(np.asarray(values, dtype=np.float64), p, method="linear"))


def tpot(first_token_time: float, last_token_time: float, output_tokens: int) -> float | None:
    """Time per output token after the first: (last - first) / (output_tokens - 1), in seconds.

    None when the request produced fewer than two tokens: TPOT is undefined then, and such a request
    is left out of the TPOT statistics (and a TPOT SLO does not apply to it).
    """
    if output_tokens < 2:
        return None
    return (last_token_time - first_token_time) / (output_tokens - 1)


def percentile_label(p: float) -> str:
    """`99.0` -> "99", `99.9` -> "99.9": the suffix used in field names such as ``p99_ttft_ms``."""
    return str(int(p)) if float(p).is_integer() else f"{p:g}"


def parse_percentiles(text: str) -> tuple[float, ...]:
    """Parse "50,90,99" into (50.0, 90.0, 99.0); raise ValueError naming the bad item."""
    out: list[float] = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            raise ValueError(
                f"bad percentile {item!r} in {text!r}: expected numbers like 50,90,99"
            ) from None
        if not 0.0 <= value <= 100.0 or math.isnan(value):
            raise ValueError(f"percentile {item!r} is outside [0, 100]")
        out.append(value)
    return tuple(out)


def latency_fields(
    name: str,
    values_s: Sequence[float],
    percentiles: Sequence[float],
    scale: float = 1000.0,
    unit: str = "ms",
) -> dict[str, float | None]:
    """``mean_/median_/std_/pXX_{name}_{unit}`` of ``values_s`` times ``scale``; None when empty.

    ``std`` is the population standard deviation (numpy's default), as in `vllm bench serve`.
    """
    keys = [f"mean_{name}_{unit}", f"median_{name}_{unit}", f"std_{name}_{unit}"]
    keys += [f"p{percentile_label(p)}_{name}_{unit}" for p in percentiles]
    if len(values_s) == 0:
        return dict.fromkeys(keys, None)
    arr = np.asarray(values_s, dtype=np.float64) * scale
    stats = [float(arr.mean()), percentile(arr, 50.0), float(arr.std())]
    stats += [percentile(arr, p) for p in percentiles]
    return dict(zip(keys, stats, strict=True))


def _server_fields(
    records: Sequence[RequestRecord], percentiles: Sequence[float]
) -> dict[str, Any]:
    """Statistics of the /perf_metrics timings of the successful requests that have them."""
    joined = [r.server for r in records if r.success and r.server is not None]
    out: dict[str, Any] = {"num_server_metrics": len(joined)}
    for name in ("prefill_queue", "prefill", "transfer", "decode_queue"):
        values = [v for s in joined if (v := getattr(s, f"{name}_s")) is not None]
        out.update(latency_fields(name, values, percentiles))
    sizes = [s.transfer_bytes for s in joined if s.transfer_bytes is not None]
    out["total_transfer_bytes"] = int(sum(sizes)) if sizes else None
    out["mean_transfer_bytes"] = float(np.mean(sizes)) if sizes else None
    # Prefix hit rate by medium: cached prompt tokens over prompt tokens, of the requests whose
    # entries say both.
    known = [s for s in joined if s.prompt_tokens and s.cached_tokens_by_medium is not None]
    prompt_tokens = sum(s.prompt_tokens or 0 for s in known)
    for medium in ("device", "host"):
        cached = sum((s.cached_tokens_by_medium or {}).get(medium, 0) for s in known)
        out[f"prefix_hit_rate_{medium}"] = cached / prompt_tokens if prompt_tokens else None
    flags = [s.prefilled_on_decode for s in joined if s.prefilled_on_decode is not None]
    out["num_prefilled_on_decode"] = sum(flags) if flags else None
    return out


def summarize_run(
    records: Sequence[RequestRecord],
    duration_s: float,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    slos: SloSpec | None = None,
) -> dict[str, Any]:
    """The metrics of one run, keyed like `vllm bench serve` where the names overlap.

    Throughputs divide by ``duration_s`` (the run's wall time, its start to the last completion,
    as vLLM's) and count successful requests only; a prompt whose length nobody knows counts as
    0 input tokens. TTFT, TPOT and E2EL statistics are over successful requests; ITL over every
    gap of every successful request, pooled. Per-request lists (seconds) are kept for plots and
    re-analysis: one entry per request, in the order of ``records``, as `vllm bench serve`
    writes them (a failed request has input length as sent, output length 0, TTFT 0.0, no ITLs
    and text ""; Duet's own ``tpots`` and ``e2els`` say null where a request has none).
    """
    if duration_s <= 0.0:
        raise ValueError(f"run duration must be positive, got {duration_s}")
    ok = [r for r in records if r.success]
    input_lens = [r.prompt_len or 0 for r in ok]
    output_lens = [r.output_tokens for r in ok]
    ttfts = [t for r in ok if (t := r.ttft) is not None]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    e2els = [t for r in ok if (t := r.e2el) is not None]
    itls = [r.itls for r in ok]
    total_in, total_out = sum(input_lens), sum(output_lens)
    out: dict[str, Any] = {
        "duration": duration_s,
        "num_prompts": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
    }
    if slos is not None:
        from cluster.bench.slo import attainment, meets

        good = sum(1 for r in records if meets(r, slos))
        out["request_goodput"] = good / duration_s
        out["slo_attainment"] = attainment(records, slos)
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("e2el", e2els)):
        out.update(latency_fields(name, values, percentiles))
    out.update(latency_fields("itl", [gap for gaps in itls for gap in gaps], percentiles))
    out.update(_server_fields(records, percentiles))
    out.update(
        {
            "input_lens": [r.prompt_len or 0 for r in records],
            "output_lens": [r.output_tokens if r.success else 0 for r in records],
            "ttfts": [(r.ttft or 0.0) if r.success else 0.0 for r in records],
            "tpots": [r.tpot if r.success else None for r in records],
            "e2els": [r.e2el if r.success else None for r in records],
            "itls": [r.itls if r.success else [] for r in records],
            "generated_texts": [r.generated_text if r.success else "" for r in records],
            "errors": [r.error for r in records],  # "" for a success, as in vllm
        }
    )
    return out
