"""From the cluster config to each worker: every setting a worker acts on reaches its WorkerSpec
and the engine built from it; the Ray options of each pool; the router's settings."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.builder import ClusterHandles, _actor_options
from cluster.config import config_from_dict
from cluster.worker_choice import WorkerSlot
from cluster.worker_specs import engine_config_for, worker_spec
from engine.engine_core import LLMEngine
from worker_common.messages import Role, WorkerDeadlines

DUMMY = {
    "model.dummy_config.model_type": "qwen2",
    "model.dummy_config.hidden_size": 48,
    "model.dummy_config.intermediate_size": 96,
    "model.dummy_config.num_hidden_layers": 3,
    "model.dummy_config.num_attention_heads": 4,
    "model.dummy_config.num_key_value_heads": 2,
    "model.dummy_config.head_dim": 16,
    "model.dummy_config.vocab_size": 300,
    "model.dummy_config.max_position_embeddings": 640,
    "model.dummy_config.rope_theta": 5000.0,
    "model.dummy_config.rope_scaling": {"rope_type": "linear", "factor": 2.0},
    "model.dummy_config.rms_norm_eps": 1e-6,
    "model.dummy_config.tie_word_embeddings": True,
}
SETTINGS: dict[str, Any] = {
    "model.source": "tiny-qwen",
    "model.load_format": "dummy",
    "model.dtype": "bfloat16",
    "model.max_model_len": 512,
    "model.seed": 7,
    **DUMMY,
    "prefill.scheduler.max_num_seqs": 5,
    "prefill.scheduler.max_num_batched_tokens": 300,
    "prefill.scheduler.prefill_chunk_size": 100,
    "prefill.prefill_deadline_s": 11.0,
    "decode.scheduler.max_num_seqs": 6,
    "decode.scheduler.max_num_batched_tokens": 400,
    "decode.scheduler.prefill_chunk_size": 200,
    "decode.page_wait_deadline_s": 12.0,
    "decode.token_deadline_s": 13.0,
    "kvcache.page_size": 8,
    "kvcache.cpu_bytes": 3 << 20,
    "kvcache.max_tokens": 600,
    "kvcache.reuse_policy": "per_request",
    "kvcache.host_tier_bytes": 1 << 20,
    "kvcache.gpu_memory_fraction": 0.6,
    "router.policy": "kv_aware",
    "stats.max_stats_len": 17,
    "stats.perf_buffer_len": 19,
    "stats.interval_s": 2.5,
    "transfer.on_failure": "recompute",
}


def nested(flat: dict[str, Any]) -> dict[str, Any]:
    """{"a.b.c": v} -> {"a": {"b": {"c": v}}}"""
    out: dict[str, Any] = {}
    for path, value in flat.items():
        *parents, leaf = path.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def test_every_worker_setting_reaches_its_spec() -> None:
    config = config_from_dict(nested(SETTINGS))
    p = worker_spec(config, Role.PREFILL, 0, "collector-x", "WARNING", "s3cret")
    d = worker_spec(config, Role.DECODE, 1, "collector-x", "WARNING", "s3cret")
    assert (p.worker_id, d.worker_id, p.role, d.role) == (
        "prefill-0",
        "decode-1",
        "prefill",
        "decode",
    )
    for spec, role in ((p, "prefill"), (d, "decode")):
        e = spec.engine
        assert (e.model, e.load_format, e.dtype, e.max_model_len, e.seed) == (
            "tiny-qwen",
            "dummy",
            "bfloat16",
            512,
            7,
        )
        assert e.dummy_config == {k.rsplit(".", 1)[1]: v for k, v in DUMMY.items()}
        scheduler = (e.max_num_seqs, e.max_num_batched_tokens, e.prefill_chunk_size)
        assert scheduler == tuple(
            SETTINGS[f"{role}.scheduler.{name}"]
            for name in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size")
        )
        assert (e.page_size, e.kv_cache_memory_bytes, e.kv_max_tokens, e.reuse_policy) == (
            8,
            3 << 20,
            600,
            "per_request",
        )
        assert e.num_pages is None  # (kvcache.num_pages: tests/cluster/test_config_models.py)
        assert e.host_tier_bytes == 1 << 20
        assert e.gpu_memory_fraction == 0.6
        assert spec.publish_kv_events  # router.policy kv_aware indexes every worker's cache
        assert (e.max_stats_len, e.max_request_stats_len, spec.stats_interval_s) == (17, 19, 2.5)
        assert spec.deadlines == WorkerDeadlines(prefill_s=11.0, page_wait_s=12.0, token_s=13.0)
        assert spec.collector_name == "collector-x" and spec.log_level == "WARNING"
        assert spec.transceiver is not None and spec.transceiver.max_stats_len == 17
        # the secret `duet serve` made travels inside the transceiver settings
        assert spec.transceiver.secret == "s3cret" and "s3cret" not in repr(spec)
        assert spec.on_transfer_failure == "recompute"


def test_the_dummy_model_is_built_as_configured() -> None:
    """The model.dummy_config.* fields shape the weights the engine runs."""
    flat = {**SETTINGS, "model.dtype": "float32"}
    engine = LLMEngine.from_config(
        worker_spec(
            config_from_dict(nested(flat)), Role.DECODE, 0, None, transfer_secret="x"
        ).engine
    )
    mc = engine.model_config
    assert (mc.hidden_size, mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim) == (
        48,
        3,
        4,
        2,
        16,
    )
    assert (mc.vocab_size, mc.intermediate_size, mc.rope_theta, mc.rms_norm_eps) == (
        300,
        96,
        5000.0,
        1e-6,
    )
    assert mc.tie_word_embeddings and mc.max_position_embeddings == 640
    assert mc.architecture == "qwen2" and mc.attention_bias  # qwen2: biased q/k/v projections
    assert mc.rope_scaling is not None and mc.rope_scaling.factor == 2.0
    assert engine.max_model_len == 512 and engine.kv.page_size == 8


@pytest.mark.parametrize("perf_buffer_len", [0, -1])
def test_per_request_stats_off_means_no_collector_and_no_engine_records(
    perf_buffer_len: int,
) -> None:
    config = config_from_dict({"stats": {"perf_buffer_len": perf_buffer_len}})
    spec = worker_spec(config, Role.DECODE, 0, "collector-x", transfer_secret="x")
    assert spec.engine.max_request_stats_len == perf_buffer_len  # no layer rewrites it
    assert (spec.collector_name is None) == (perf_buffer_len == 0)


@pytest.mark.parametrize(("given", "engine"), [("auto", "float32"), ("half", "float16")])
def test_every_worker_gets_the_dtype_resolved_once(given: str, engine: str) -> None:
    # auto: the embedded GGUF's (float32), read in the server process, so that no worker reads
    # its own (and prefill and decode workers cannot disagree).
    config = config_from_dict({"model": {"dtype": given}})
    for role in (Role.PREFILL, Role.DECODE):
        assert worker_spec(config, role, 0, None, transfer_secret="x").engine.dtype == engine


def test_a_checkpoint_auto_cannot_read_is_a_config_error(tmp_path) -> None:
    from cluster.config import ConfigError

    (tmp_path / "config.json").write_text("{")  # (truncated)
    config = config_from_dict({"model": {"source": str(tmp_path), "dtype": "auto"}})
    with pytest.raises(ConfigError, match="model.dtype: auto reads the checkpoint's dtype"):
        worker_spec(config, Role.DECODE, 0, None, transfer_secret="x")


def test_an_aggregated_decode_worker_has_no_transceiver() -> None:
    config = config_from_dict({"prefill": {"replicas": 0}, "decode": {"replicas": 2}})
    assert worker_spec(config, Role.DECODE, 1, None).transceiver is None


def test_each_pool_gets_its_own_ray_options() -> None:
    config = config_from_dict(
        nested(
            {
                "prefill.resources.num_cpus": 2.0,
                "prefill.resources.num_gpus": 0.5,
                "prefill.resources.resources": {"prefill_node": 1},
                "prefill.resources.label_selector": {"zone": "a"},
                "decode.resources.num_cpus": 3.0,
                "decode.resources.num_gpus": 1.0,
                "decode.resources.resources": {"decode_node": 2},
                "decode.resources.label_selector": {"zone": "b"},
            }
        )
    )
    p, d = _actor_options(config, "prefill", 0), _actor_options(config, "decode", 0)
    assert (p["num_cpus"], p["num_gpus"], p["resources"], p["label_selector"]) == (
        2.0,
        0.5,
        {"prefill_node": 1.0},
        {"zone": "a"},
    )
    assert (d["num_cpus"], d["num_gpus"], d["resources"], d["label_selector"]) == (
        3.0,
        1.0,
        {"decode_node": 2.0},
        {"zone": "b"},
    )
    # GPU workers of a disaggregated cluster with direct copies see every GPU of their node.
    assert d["runtime_env"] == {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
    assert p["max_task_retries"] == 0 and p["max_restarts"] == 3


def test_the_router_gets_the_router_and_server_settings() -> None:
    config = config_from_dict(
        nested(
            {
                "router.policy": "round_robin",
                "router.prefill_retries": 3,
                "router.local_prefill_fallback": False,
                "router.local_prefill_max_tokens": 24,
                "server.request_timeout_s": 42.0,
                "kvcache.page_size": 32,
            }
        )
    )
    handles = ClusterHandles(config, None, [WorkerSlot("p", None)], [WorkerSlot("d", None)])
    r = handles.router()
    assert (r.choice.policy, r.prefill_retries, r.local_prefill_fallback) == (
        "round_robin",
        3,
        False,
    )
    assert (r.call_timeout_s, r.choice.page_size) == (42.0, 32)
    assert r.choice.local_prefill_max_tokens == 24 and r.choice.kv_index is not None


def test_kvcache_num_pages_reaches_the_engine_instead_of_a_budget() -> None:
    config = config_from_dict({"kvcache": {"num_pages": 90}})
    e = worker_spec(config, Role.DECODE, 0, None, transfer_secret="x").engine
    assert (e.num_pages, e.kv_cache_memory_bytes, e.kv_max_tokens) == (90, None, None)


@pytest.mark.parametrize("aggregated", [True, False])
def test_a_tensor_parallel_gpu_worker_sees_every_gpu_of_its_node(aggregated: bool) -> None:
    """Its ranks pick their GPUs by Ray's ids among all of the node's: with Ray's narrowing (an
    aggregated cluster, or direct_copy off), rank 0 saw one GPU and refused to start ("needs 2
    GPUs, this host has 1")."""
    settings = {
        "decode.resources.num_gpus": 1.0,
        "decode.tensor_parallel_size": 2,
        "transfer.direct_copy": False,
    }
    if aggregated:
        settings["prefill.replicas"] = 0
    config = config_from_dict(nested(settings))
    d = _actor_options(config, "decode", 0)
    assert d["runtime_env"] == {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
    config = config_from_dict(nested({**settings, "decode.tensor_parallel_size": 1}))
    assert "runtime_env" not in _actor_options(config, "decode", 0)


def test_a_relative_model_path_reaches_the_workers_absolute(tmp_path, monkeypatch) -> None:
    """model.source is relative to the working directory of `duet serve`: a worker, whose own is
    Ray's (an unpacked working_dir, or where `ray start` ran), looked for it there and failed
    after every check of the server had passed."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.gguf").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    config = config_from_dict(nested({"model.source": "models/m.gguf"}))
    spec = worker_spec(config, Role.DECODE, 0, None, transfer_secret="s3cret" * 6)
    assert spec.engine.model == str(tmp_path / "models" / "m.gguf")
    assert config.model.model_name == "m"  # (the served name is the file's, as before)
    default = worker_spec(config_from_dict({}), Role.DECODE, 0, None, transfer_secret="s3cret" * 6)
    assert default.engine.model == "default"


def test_a_worker_sharing_its_gpu_takes_its_share_of_the_whole_memory() -> None:
    """Workers sharing a GPU (resources.num_gpus 0.5) each measured the same free memory at
    start and took kvcache.gpu_memory_fraction of it: the second ran out of memory. Sharing, a
    worker is sized as vLLM's gpu_memory_utilization, its share of the whole memory."""
    shared = {"prefill.resources.num_gpus": 0.5, "decode.resources.num_gpus": 0.5}
    config = config_from_dict(nested({**shared, "kvcache.gpu_memory_fraction": 0.8}))
    for role in (Role.PREFILL, Role.DECODE):
        engine = engine_config_for(config, role)
        assert engine.device == "cuda" and engine.gpu_memory_utilization == 0.4
    own = config_from_dict(nested({"decode.resources.num_gpus": 1.0}))
    assert engine_config_for(own, Role.DECODE).gpu_memory_utilization is None  # (its free memory)
    assert engine_config_for(config_from_dict({}), Role.DECODE).gpu_memory_utilization is None
