"""Shared factories for cluster tests: per-request timing records with exact (binary) values, the
issues a cluster config is refused with, and the HTTP edge over a real decode worker (``backend``:
tests/cluster/worker_backend.py, ``http``: a test client of the app over it; one per module)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from cluster.config import ConfigError, config_from_dict
from cluster.messages import RequestTimings, Role
from cluster.server import create_app
from decode_worker.worker import DecodeWorker
from engine.engine_config import EngineConfig
from engine.engine_core import LLMEngine
from engine.loaders.load import LoadedModel
from tests.cluster.worker_backend import WorkerBackend


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
    """A decode worker's report: arrives at 100.75, receives KV 101-101.5, samples 4 tokens at
    101.75, 102, 102.5 and 103 (3 gaps: the one from P's first token is no gap of its own)."""
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
        token_gaps_s=(0.25, 0.5, 0.5),
        finish_reason="length",
    )
    fields.update(overrides)
    return RequestTimings(request_id=request_id, role=Role.DECODE, worker_id=worker_id, **fields)


def issues_of(data: dict) -> list[str]:
    """The issues ``data`` (a cluster YAML as a dict) is refused with, field by field."""
    with pytest.raises(ConfigError) as caught:
        config_from_dict(data)
    return caught.value.issues


@pytest.fixture(scope="module")
def backend(default_model: LoadedModel) -> Iterator[WorkerBackend]:
    config = EngineConfig(num_pages=64, page_size=16, max_model_len=512, max_num_seqs=4)
    worker = DecodeWorker("d0", LLMEngine.from_loaded(default_model, config), puller=None)
    try:
        yield WorkerBackend(worker)
    finally:
        worker.close()


@pytest.fixture(scope="module")
def http(backend: WorkerBackend) -> Iterator[TestClient]:
    with TestClient(create_app(backend), raise_server_exceptions=False) as client:
        yield client
