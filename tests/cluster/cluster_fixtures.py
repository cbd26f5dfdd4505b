"""Shared helpers of the cluster end-to-end tests: a running local cluster and the HF oracle."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ray

from cluster.config import ClusterConfig, load_config
from tests.oracle import hf_greedy as hf_greedy_ids  # noqa: F401 (re-exported for the cluster tests)
from worker_common.messages import WorkerStats

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def local_ray(namespace: str) -> Iterator[None]:
    """A fresh Ray of our own on 127.0.0.1 with 2 CPUs (address="local": never someone else's
    running cluster), shut down on exit."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        namespace=namespace,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


def local_config(name: str = "local.yaml", **overrides: Any) -> ClusterConfig:
    """configs/<name> with the HTTP port set to 0 (any free port) and optional section overrides."""
    cfg = load_config(REPO / "configs" / name)
    data = cfg.model_dump(mode="json")
    data["server"]["port"] = 0
    for section, values in overrides.items():
        data[section].update(values)
    from cluster.config import config_from_dict

    return config_from_dict(data)


def worker_stats(running: Any) -> list[WorkerStats]:
    slots = running.handles.prefill + running.handles.decode
    return ray.get([w.handle.stats.remote() for w in slots], timeout=30)


def wait_no_pages_held(running: Any, timeout_s: float = 30.0) -> list[WorkerStats]:
    """Poll until no worker holds a page for a request (leases released, receives ended); return the
    last stats. Cached pages nobody holds (evictable) are fine: they are what prefix reuse keeps."""
    from ray.exceptions import GetTimeoutError, RayActorError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            stats = worker_stats(running)
        except (RayActorError, GetTimeoutError) as e:
            # A worker Ray is restarting (a test killed it) cannot answer yet; its restarted self
            # must, and must hold nothing, before the deadline.
            if time.monotonic() > deadline:
                raise AssertionError(f"a worker did not answer within {timeout_s}s: {e}") from e
            time.sleep(0.5)
            continue
        held = {s.worker_id: sum(g.used for g in s.kv.groups.values()) for s in stats}
        if not any(held.values()):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"pages still held after {timeout_s}s: {held}")
        time.sleep(0.2)


def get_json(url: str, path: str) -> Any:
    r = httpx.get(url + path, timeout=30)
    r.raise_for_status()
    return r.json()
