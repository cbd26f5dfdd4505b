"""Every Duet config shipped in configs/ validates, and says what its name promises."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cluster.config import ClusterConfig, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
NOT_DUET = {"ray_cluster_launcher.yaml"}  # Ray's own file format
DUET_CONFIGS = sorted(p.name for p in CONFIGS.glob("*.yaml") if p.name not in NOT_DUET)


def load(name: str) -> ClusterConfig:
    return load_config(CONFIGS / name)


def test_the_expected_configs_are_there() -> None:
    assert DUET_CONFIGS == [
        "gpu_1p1d.yaml",
        "gpu_1p1d_aggregated.yaml",
        "gpu_2p2d.yaml",
        "gpu_2p2d_aggregated.yaml",
        "gpu_tp.yaml",
        "local.yaml",
        "local_aggregated.yaml",
    ]


@pytest.mark.parametrize("name", DUET_CONFIGS)
def test_duet_config_validates(name: str) -> None:
    config = load(name)
    assert config.server.host == "127.0.0.1"
    assert config.ray.address is None


@pytest.mark.parametrize("name", ["local.yaml", "local_aggregated.yaml"])
def test_local_configs_run_the_embedded_model_on_cpu_on_loopback(name: str) -> None:
    config = load(name)
    assert config.model.is_embedded
    assert config.model.dtype == "float32"
    assert not config.uses_gpu
    assert config.transfer.host == "127.0.0.1"
    assert config.transfer.ucx_net_devices == "lo"
    assert config.kvcache.cpu_bytes <= 256 * 2**20  # small: several engineers share the machine
    assert config.num_workers == 2  # the same hardware for the disaggregated and aggregated runs


@pytest.mark.parametrize(("name", "pairs"), [("local", 1), ("gpu_1p1d", 1), ("gpu_2p2d", 2)])
def test_aggregated_twin_differs_only_in_the_pools(name: str, pairs: int) -> None:
    local, aggregated = load(f"{name}.yaml"), load(f"{name}_aggregated.yaml")
    assert (local.prefill.replicas, local.decode.replicas) == (pairs, pairs)
    assert (aggregated.prefill.replicas, aggregated.decode.replicas) == (0, 2 * pairs)
    assert not local.aggregated and aggregated.aggregated
    assert aggregated.decode.resources == local.decode.resources
    assert aggregated.decode.scheduler == local.decode.scheduler
    for section in ("model", "kvcache", "server", "stats", "ray"):
        assert getattr(aggregated, section) == getattr(local, section), section


@pytest.mark.parametrize(("name", "replicas"), [("gpu_1p1d.yaml", 1), ("gpu_2p2d.yaml", 2)])
def test_gpu_configs_are_llama3_8b_dummy_one_gpu_per_worker(name: str, replicas: int) -> None:
    config = load(name)
    assert (config.prefill.replicas, config.decode.replicas) == (replicas, replicas)
    assert config.model.load_format == "dummy" and config.model.dtype == "bfloat16"
    dims = config.model.dummy_config
    assert dims is not None
    assert (dims.hidden_size, dims.num_hidden_layers, dims.num_attention_heads) == (4096, 32, 32)
    assert (dims.num_key_value_heads, dims.resolved_head_dim, dims.vocab_size) == (8, 128, 128256)
    assert config.prefill.resources.num_gpus == 1 and config.decode.resources.num_gpus == 1
    assert config.uses_gpu
    assert config.transfer.ucx_tls is not None and "cuda_ipc" in config.transfer.ucx_tls
    assert config.transfer.ucx_environment["UCX_TLS"] == "tcp,cuda_copy,cuda_ipc"


def test_ray_cluster_launcher_example_is_yaml() -> None:
    data = yaml.safe_load((CONFIGS / "ray_cluster_launcher.yaml").read_text())
    assert isinstance(data, dict)
    assert data["head_node_type"] in data["available_node_types"]
    assert {"prefill_gpu", "decode_gpu"} <= data["available_node_types"].keys()


def test_gpu_tp_config_is_70b_shaped_tp2_each_side_on_four_gpus() -> None:
    """configs/gpu_tp.yaml: the split passes the model checks of cluster/preflight.py, and
    scripts/gpu_tp_check.py --dry-run (what its GPU run starts with) accepts it."""
    import subprocess
    import sys

    from cluster.preflight import tensor_parallel_issues
    from engine.loaders import read_model_config

    cfg = load("gpu_tp.yaml")
    assert (cfg.prefill.tensor_parallel_size, cfg.decode.tensor_parallel_size) == (2, 2)
    assert cfg.prefill.resources.num_gpus == cfg.decode.resources.num_gpus == 1
    dummy = cfg.model.dummy_config
    assert dummy is not None
    model = read_model_config(cfg.model.source, "dummy", dummy.as_hf_dict())
    assert (model.hidden_size, model.num_layers, model.num_heads, model.num_kv_heads) == (
        8192,
        80,
        64,
        8,
    )
    assert tensor_parallel_issues(cfg, model) == []
    script = CONFIGS.parent / "scripts" / "gpu_tp_check.py"
    done = subprocess.run(
        [sys.executable, str(script), "--dry-run"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert '"decode_tp": 2' in done.stdout
