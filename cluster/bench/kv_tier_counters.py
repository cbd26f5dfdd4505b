"""What a Duet server's KV host tiers did during one benchmark run, from its /metrics.

The workers' host-tier counters (cluster/kv_cache_metrics.py: ``duet:kv_offloaded_pages_total``, ...,
labelled by worker, pool group and ``medium="host"``) are read before and after the run; the run's
figures are the differences, summed over the workers, per pool group and in all. A server whose
/metrics has no host series (no host tier, or not Duet) gives None: nothing is reported.

The server exports what its stats poller last heard from each worker (every ``stats.interval_s``),
so the read after a run waits for one such interval past the run's end when the caller knows it
(a cluster the driver started); otherwise the figures may miss the run's last interval.
"""

from __future__ import annotations

import logging

import httpx
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

# Run-entry key -> the metric family (its name without ``_total``, as the parser gives it).
HOST_COUNTERS = {
    "offloaded_pages": "duet:kv_offloaded_pages",
    "loaded_back_pages": "duet:kv_loaded_back_pages",
    "host_hit_tokens": "duet:kv_host_hit_tokens",
    "host_drops": "duet:kv_host_drops",
    "skipped_stores": "duet:kv_skipped_stores",
}

# key -> pool group -> total over the workers
Totals = dict[str, dict[str, float]]


def parse_kv_tier_totals(text: str) -> Totals | None:
    """The host-tier counters of a /metrics text, summed over workers per pool group; None when
    it has no host series."""
    families = {f.name: f for f in text_string_to_metric_families(text)}
    totals: Totals = {}
    for key, name in HOST_COUNTERS.items():
        family = families.get(name)
        if family is None:
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total") or sample.labels.get("medium") != "host":
                continue
            group = sample.labels.get("group", "")
            per_group = totals.setdefault(key, {})
            per_group[group] = per_group.get(group, 0.0) + sample.value
    return totals or None


async def fetch_kv_tier_totals(base_url: str, timeout_s: float = 10.0) -> Totals | None:
    """The server's host-tier counters now, or None (no host tier, no /metrics, an error)."""
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s) as http:
            response = await http.get("/metrics")
        if response.status_code != 200:
            return None
        return parse_kv_tier_totals(response.text)
    except (httpx.HTTPError, ValueError) as exc:
        log.info("no KV tier counters from %s: %s", base_url, exc)
        return None


def kv_tier_fields(before: Totals | None, after: Totals | None) -> dict[str, object]:
    """A run's entry fields: ``kv_host_<key>`` (the run's total over groups and workers) and
    ``kv_host_by_group`` ({group: {key: n}}); empty when the server has no host tier. A total
    that went down (the server restarted) counts from zero again, as Prometheus' ``increase``
    does."""
    if after is None:
        return {}
    before = before or {}
    by_group: dict[str, dict[str, int]] = {}
    for key in HOST_COUNTERS:
        for group, total in after.get(key, {}).items():
            previous = before.get(key, {}).get(group, 0.0)
            delta = total - previous if total >= previous else total
            by_group.setdefault(group, {})[key] = int(delta)
    out: dict[str, object] = {
        f"kv_host_{key}": sum(g.get(key, 0) for g in by_group.values()) for key in HOST_COUNTERS
    }
    out["kv_host_by_group"] = by_group
    return out
