"""Shared factories for cluster tests: per-request timing records with exact (binary) values, and
the issues a cluster config is refused with."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.config import ConfigError, config_from_dict
from cluster.messages import RequestTimings, Role


def prefill_timings(request_id: str, worker_id: str = "p0", **overrides: Any) -> RequestTimings:
    """A prefill worker's report: arrives at 100, prefills 100.25-100.75, transfers 101-101.5."""
    fields: dict[str, Any] = dict(
        arrival_time=100.0,
        queue_start=100.0,
        queue_end=100.25,
        prefill_start=100.25,
        prefill_end=100.75,
        first_token_time=100.75,
        transfer_start=101.0,
        transfer_end=101.5,
        transfer_bytes=4096,
        finish_time=101.5,
        prompt_tokens=32,
        cached_tokens=16,
        output_tokens=1,
    )
    fields.update(overrides)
    return RequestTimings(request_id=request_id, role=Role.PREFILL, worker_id=worker_id, **fields)


def decode_timings(request_id: str, worker_id: str = "d0", **overrides: Any) -> RequestTimings:
    """A decode worker's report: arrives at 100.75, receives KV 101-101.5, decodes 4 tokens by 103."""
    fields: dict[str, Any] = dict(
        arrival_time=100.75,
        queue_start=101.5,
        queue_end=101.625,
        transfer_start=101.0,
        transfer_end=101.5,
        transfer_bytes=4096,
        decode_start=101.625,
        last_token_time=103.0,
        finish_time=103.0,
        output_tokens=4,
        token_gaps_s=(1.0, 0.25, 0.5, 0.5),
        finish_reason="length",
    )
    fields.update(overrides)
    return RequestTimings(request_id=request_id, role=Role.DECODE, worker_id=worker_id, **fields)


def issues_of(data: dict) -> list[str]:
    """The issues ``data`` (a cluster YAML as a dict) is refused with, field by field."""
    with pytest.raises(ConfigError) as caught:
        config_from_dict(data)
    return caught.value.issues
