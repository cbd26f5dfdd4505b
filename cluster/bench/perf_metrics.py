"""Server-side disaggregated timings from a Duet server's /perf_metrics, joined to client records.

Expected contract (what the Duet HTTP server is to serve; other servers simply lack the route):
``GET /perf_metrics`` returns JSON, either a list of entries or ``{"requests": [entries]}``, each

    {"request_id": "<the `id` of the request's streamed chunks>",
     "prefill_queue_time": s, "prefill_time": s, "transfer_time": s,
     "transfer_bytes": n, "decode_queue_time": s, "prompt_tokens": n,
     "cached_tokens_by_medium": {"device": n, "host": n},
     "prefill": {...} or null, "decode": {...} or null}

with times in seconds. Any field may be missing or null; unknown fields are ignored. Entries may be
drained by the read (as TensorRT-LLM's route does), and may show up a little after the request's
stream ended (workers report in the background): after each run the driver polls until every
successful request has its entry, or a bounded wait has passed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from cluster.bench.records import RequestRecord, ServerTimings

log = logging.getLogger(__name__)

_FIELDS = {
    "prefill_queue_time": "prefill_queue_s",
    "prefill_time": "prefill_s",
    "transfer_time": "transfer_s",
    "transfer_bytes": "transfer_bytes",
    "decode_queue_time": "decode_queue_s",
}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def parse_perf_metrics(payload: Any) -> dict[str, ServerTimings]:
    """Entries of a /perf_metrics response keyed by request id; malformed entries are skipped."""
    entries = payload.get("requests") if isinstance(payload, dict) else payload
    if not isinstance(entries, list):
        return {}
    out: dict[str, ServerTimings] = {}
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("request_id"), str):
            continue
        values: dict[str, Any] = {attr: _number(entry.get(key)) for key, attr in _FIELDS.items()}
        for name in ("transfer_bytes", "prompt_tokens"):
            number = _number(entry.get(name))
            values[name] = int(number) if number is not None else None
        by_medium = entry.get("cached_tokens_by_medium")
        if isinstance(by_medium, dict):
            values["cached_tokens_by_medium"] = {
                str(medium): int(n) for medium, n in by_medium.items() if _number(n) is not None
            }
        if "prefill" in entry and "decode" in entry:
            values["prefilled_on_decode"] = entry["prefill"] is None and entry["decode"] is not None
        out[entry["request_id"]] = ServerTimings(**values)
    return out


def join_server_timings(records: Sequence[RequestRecord], timings: dict[str, ServerTimings]) -> int:
    """Attach timings to the records whose response id has an entry; returns how many matched."""
    matched = 0
    for record in records:
        found = timings.get(record.response_id) if record.response_id else None
        if found is not None:
            record.server = found
            matched += 1
    return matched


async def fetch_perf_metrics(
    base_url: str, timeout_s: float = 10.0, headers: Mapping[str, str] | None = None
) -> dict[str, ServerTimings] | None:
    """The server's /perf_metrics, or None when it has none (a peer that is not Duet) or fails.

    Missing server metrics never fail a benchmark: the client-side metrics stand on their own.
    """
    try:
        async with httpx.AsyncClient(
            base_url=base_url, timeout=timeout_s, headers=dict(headers or {})
        ) as http:
            response = await http.get("/perf_metrics")
        if response.status_code != 200:
            return None
        return parse_perf_metrics(response.json())
    except (httpx.HTTPError, ValueError) as exc:
        log.info("no /perf_metrics from %s: %s", base_url, exc)
        return None


async def collect_server_timings(
    base_url: str,
    records: Sequence[RequestRecord],
    wait_s: float,
    poll_s: float = 0.25,
    headers: Mapping[str, str] | None = None,
) -> int:
    """Poll /perf_metrics until every successful record has its timings or ``wait_s`` passed.

    Returns how many records got timings. Stops at once when the server has no such route.
    Entries of other requests (a warm-up, an earlier run) are read and dropped.
    """
    wanted = {r.response_id for r in records if r.success and r.response_id}
    found: dict[str, ServerTimings] = {}
    deadline = time.monotonic() + wait_s
    while True:
        timings = await fetch_perf_metrics(base_url, headers=headers)
        if timings is None:
            break
        found.update({k: v for k, v in timings.items() if k in wanted})
        if wanted <= found.keys() or time.monotonic() >= deadline:
            break
        await asyncio.sleep(poll_s)
    return join_server_timings(records, found)
