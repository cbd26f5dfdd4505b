"""A worker's engine from its spec: the KV fields of the cluster config reach the engine's pools,
a cache the config cannot size stops the worker with a ConfigError naming the cluster fields, and
hybrid models build on both roles of a disaggregated cluster."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cluster.config import ClusterConfig, ConfigError, config_from_dict
from cluster.worker_specs import worker_spec
from tests.engine.conftest import HYBRID_HF_CONFIGS, write_tiny_checkpoint
from worker_common.engine_setup import build_engine
from worker_common.messages import Role


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    """build_engine sizes the process's torch threads to the worker's CPUs: undone for later tests."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 3 (5 sliding layers with a window of 32 : 1 full layer)."""
    root = tmp_path_factory.mktemp("gemma")
    return write_tiny_checkpoint(root / "gemma3", HYBRID_HF_CONFIGS["gemma3"], seed=3)


def cluster(gemma_dir: Path, kvcache: dict, prefill_replicas: int = 0) -> ClusterConfig:
    return config_from_dict(
        {
            "model": {"source": str(gemma_dir), "max_model_len": 256},
            "kvcache": {"page_size": 8, **kvcache},
            "prefill": {"replicas": prefill_replicas},
            "decode": {"scheduler": {"prefill_chunk_size": 24}},
        }
    )


def test_pool_ratio_and_scratch_reuse_reach_the_pools(gemma_dir: Path) -> None:
    kvcache = {
        "cpu_bytes": 1 << 21,
        "pool_ratio": {"full": 1, "swa_32": 1},
        "swa_scratch_reuse": True,
    }
    spec = worker_spec(cluster(gemma_dir, kvcache), Role.DECODE, 0, None)
    # kvcache.pool_ratio and kvcache.swa_scratch_reuse reach the engine config, then the pools
    assert spec.engine.pool_ratio == {"full": 1, "swa_32": 1}
    assert spec.engine.swa_scratch_reuse
    kv = build_engine(spec).kv
    assert kv.swa_scratch_reuse
    # equal bytes: a full page holds 1 layer, a window page 5
    assert kv.specs["full"].num_pages == (1 << 20) // kv.specs["full"].page_bytes
    assert kv.specs["swa_32"].num_pages == (1 << 20) // kv.specs["swa_32"].page_bytes


def test_pool_ratio_naming_a_missing_group_stops_the_worker(gemma_dir: Path) -> None:
    config = cluster(gemma_dir, {"pool_ratio": {"full": 1, "swa_4096": 1}})
    with pytest.raises(ConfigError) as e:
        build_engine(worker_spec(config, Role.DECODE, 0, None))
    assert e.value.source == "decode-0 start-up"
    again = pickle.loads(pickle.dumps(e.value))  # crosses Ray as itself
    assert (type(again), again.source, again.issues) == (
        ConfigError,
        e.value.source,
        e.value.issues,
    )
    (issue,) = e.value.issues
    assert issue.startswith("kvcache.pool_ratio: pool_ratio names ['swa_4096']")
    assert "the model's pool groups are ['full', 'swa_32']" in issue


def test_a_group_too_small_for_one_request_stops_the_worker(gemma_dir: Path) -> None:
    # 1/301 of 16 MiB for the window group: 5 pages of 10 KiB, where one request needs 8 + 1
    config = cluster(gemma_dir, {"cpu_bytes": 1 << 24, "pool_ratio": {"full": 300, "swa_32": 1}})
    with pytest.raises(ConfigError) as e:
        build_engine(worker_spec(config, Role.DECODE, 0, None))
    (issue,) = e.value.issues
    assert issue.startswith("kvcache.num_pages / cpu_bytes / gpu_memory_fraction / pool_ratio")
    assert "group 'swa_32' has 4 usable pages, one request needs 8" in issue


def test_a_host_tier_below_one_page_stops_the_worker(gemma_dir: Path) -> None:
    config = cluster(gemma_dir, {"host_tier_bytes": 4096})
    with pytest.raises(ConfigError) as e:
        build_engine(worker_spec(config, Role.DECODE, 0, None))
    (issue,) = e.value.issues
    assert issue.startswith(
        "kvcache.host_tier_bytes: the host tier (host_tier_bytes 4096 B) holds less than one"
    )
    big = cluster(gemma_dir, {"host_tier_bytes": 1 << 20})
    tier = build_engine(worker_spec(big, Role.DECODE, 0, None)).kv.host_tier
    assert tier is not None and set(tier.pools) == {"full", "swa_32"}


def test_hybrid_models_serve_disaggregated(gemma_dir: Path) -> None:
    """A model with sliding-window pool groups builds on both roles of a disaggregated cluster
    (its KV moves group by group: tests/cluster/test_cluster_hybrid.py)."""
    config = cluster(gemma_dir, {}, prefill_replicas=1)
    for role in Role:
        spec = worker_spec(config, role, 0, None, transfer_secret="test")
        assert spec.transceiver is not None
        assert build_engine(spec).kv.specs["swa_32"].sliding_window == 32


def test_a_cpu_worker_runs_torch_threads_for_its_cpus(gemma_dir: Path) -> None:
    config = config_from_dict(
        {
            "model": {"source": str(gemma_dir), "max_model_len": 256},
            "kvcache": {"page_size": 8},
            "prefill": {"replicas": 0},
            "decode": {"resources": {"num_cpus": 1}},
        }
    )
    spec = worker_spec(config, Role.DECODE, 0, None)
    assert spec.num_cpus == 1
    torch.set_num_threads(2)
    build_engine(spec)
    assert torch.get_num_threads() == 1
