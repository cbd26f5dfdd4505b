"""The config sections' own rules: defaults, bounds, cross-field checks, derived values."""

from __future__ import annotations

import pydantic
import pytest
from pydantic import BaseModel

from cluster.config import (
    ClusterConfig,
    ConfigError,
    DummyModelConfig,
    KVCacheConfig,
    TransferConfig,
    WorkerResources,
    config_from_dict,
)

TINY_DUMMY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "max_position_embeddings": 256,
}


def issues_of(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        config_from_dict(data)
    return caught.value.issues


def all_sections(model: type[BaseModel], seen: set[type[BaseModel]]) -> set[type[BaseModel]]:
    seen.add(model)
    for field in model.model_fields.values():
        for candidate in (field.annotation, *getattr(field.annotation, "__args__", ())):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                if candidate not in seen:
                    all_sections(candidate, seen)
    return seen


def test_empty_config_is_local_disaggregated_cpu() -> None:
    config = config_from_dict({})
    assert config.model.is_embedded
    assert config.model.model_name == "SmolLM2-135M-Instruct"
    assert (config.prefill.replicas, config.decode.replicas) == (1, 1)
    assert not config.aggregated and not config.uses_gpu
    assert config.num_workers == 2
    assert config.server.host == "127.0.0.1" and config.transfer.host == "127.0.0.1"
    assert config.ray.starts_local
    assert config.router.prefill_retries == 1


def test_every_field_of_every_section_has_a_description() -> None:
    sections = all_sections(ClusterConfig, set())
    assert len(sections) == 14
    missing = [
        f"{section.__name__}.{name}"
        for section in sections
        for name, field in section.model_fields.items()
        if not field.description
    ]
    assert missing == []


def test_sections_are_frozen() -> None:
    config = config_from_dict({})
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        config.prefill.replicas = 3  # type: ignore[misc]


def test_aggregated_when_no_prefill_workers() -> None:
    config = config_from_dict({"prefill": {"replicas": 0, "resources": {"num_gpus": 1}}})
    assert config.aggregated
    assert config.num_workers == 1
    assert not config.uses_gpu  # the prefill pool's GPU ask is moot without prefill workers


def test_replica_bounds() -> None:
    assert issues_of({"prefill": {"replicas": -1}, "decode": {"replicas": 0}}) == [
        "prefill.replicas: must be >= 0, got -1",
        "decode.replicas: must be >= 1, got 0",
    ]


def test_prefill_chunk_must_fit_a_step() -> None:
    data = {"decode": {"scheduler": {"max_num_batched_tokens": 256, "prefill_chunk_size": 512}}}
    assert issues_of(data) == [
        "decode.scheduler.prefill_chunk_size: must be <= max_num_batched_tokens (256), got 512"
    ]


def test_worker_resources() -> None:
    resources = WorkerResources(
        num_cpus=2, num_gpus=1, resources={"decode_node": 1}, label_selector={"zone": "a"}
    )
    assert resources.ray_actor_options == {
        "num_cpus": 2.0,
        "num_gpus": 1.0,
        "resources": {"decode_node": 1.0},
        "label_selector": {"zone": "a"},
    }
    assert WorkerResources().ray_actor_options == {"num_cpus": 1.0, "num_gpus": 0.0}
    assert WorkerResources(num_gpus=0.5).num_gpus == 0.5
    data = {"prefill": {"resources": {"num_gpus": 2, "resources": {"GPU": 1, "x": -1}}}}
    assert issues_of(data) == [
        "prefill.resources.num_gpus: must be <= 1: a rank runs on one GPU (for more GPUs per "
        "worker, raise tensor_parallel_size), got 2",
        "prefill.resources.resources: built-in resources ['GPU'] go in num_cpus / num_gpus, "
        "not in resources",
    ]
    bundle = WorkerResources(num_cpus=0.5, num_gpus=1, resources={"node_a": 1}).bundle
    assert bundle == {"CPU": 0.5, "GPU": 1.0, "node_a": 1.0}
    assert WorkerResources(num_cpus=1, num_gpus=0).bundle == {"CPU": 1.0}


def test_a_label_selector_ray_would_refuse_or_never_match_is_refused_at_load() -> None:
    """(what each value admits: tests/cluster/test_label_selector.py)"""
    data = {"decode": {"resources": {"label_selector": {"zone": "in(a, b)", "gpu": "!H200"}}}}
    assert issues_of(data) == [
        "decode.resources.label_selector: zone: 'in(a, b)': no spaces after the commas (Ray keeps "
        "them in the next value, which then matches no node): write 'in(a,b)'"
    ]


def test_tensor_parallel_size_counts_ranks_of_a_gpu_each() -> None:
    """prefill.tensor_parallel_size and decode.tensor_parallel_size: ranks per worker (default 1),
    each with resources.num_gpus of 0 or 1 (ranks of one worker never share a GPU); the checks
    against the model and the nodes are in tests/cluster/test_preflight.py."""
    config = config_from_dict({"prefill": {"tensor_parallel_size": 2}})
    assert (config.prefill.num_ranks, config.decode.num_ranks) == (2, 1)
    assert (
        config_from_dict({"decode": {"tensor_parallel_size": 4}}).decode.tensor_parallel_size == 4
    )
    assert issues_of(
        {"prefill": {"tensor_parallel_size": 0}, "decode": {"tensor_parallel_size": -1}}
    ) == [
        "prefill.tensor_parallel_size: must be >= 1, got 0",
        "decode.tensor_parallel_size: must be >= 1, got -1",
    ]
    shared = {"tensor_parallel_size": 2, "resources": {"num_gpus": 0.5}}
    assert issues_of({"decode": shared}) == [
        "decode.resources.num_gpus: must be 0 or 1 with tensor_parallel_size 2 (each rank needs a "
        "GPU of its own), got 0.5"
    ]
    assert config_from_dict({"decode": {"resources": {"num_gpus": 0.5}}}).decode.num_ranks == 1


def test_dummy_config_required_iff_load_format_dummy() -> None:
    assert issues_of({"model": {"load_format": "dummy"}}) == [
        "model.dummy_config: required when load_format is 'dummy'"
    ]
    assert issues_of({"model": {"load_format": "gguf", "dummy_config": TINY_DUMMY}}) == [
        "model.dummy_config: only allowed with load_format 'dummy', got 'gguf'"
    ]
    model = config_from_dict(
        {"model": {"source": "tiny", "load_format": "dummy", "dummy_config": TINY_DUMMY}}
    ).model
    assert not model.is_embedded
    assert model.model_name == "tiny"
    assert model.dummy_config is not None
    assert model.dummy_config.as_hf_dict()["head_dim"] == 16


def test_dummy_config_head_checks() -> None:
    with pytest.raises(pydantic.ValidationError) as caught:
        DummyModelConfig(**{**TINY_DUMMY, "num_key_value_heads": 3, "hidden_size": 66})
    text = str(caught.value)
    assert "num_key_value_heads: must divide num_attention_heads (4), got 3" in text
    assert "hidden_size: must be a multiple of num_attention_heads (4)" in text
    explicit = DummyModelConfig(**{**TINY_DUMMY, "hidden_size": 66, "head_dim": 32})
    assert explicit.resolved_head_dim == 32


def test_max_model_len_within_dummy_positions() -> None:
    data = {"model": {"load_format": "dummy", "dummy_config": TINY_DUMMY, "max_model_len": 512}}
    assert issues_of(data) == [
        "model.max_model_len: must be <= dummy_config.max_position_embeddings (256), got 512"
    ]


def test_embedded_model_is_not_an_hf_checkpoint() -> None:
    assert issues_of({"model": {"load_format": "hf"}}) == [
        "model.load_format: the embedded model is a GGUF file: must be one of 'auto', 'gguf', "
        "'dummy' with source 'default', got 'hf'"
    ]


@pytest.mark.parametrize(
    ("source", "name"),
    [("models/Qwen2.5-0.5B", "Qwen2.5-0.5B"), ("/m/smol.Q8_0.gguf", "smol.Q8_0")],
)
def test_model_name_from_source(source: str, name: str) -> None:
    assert config_from_dict({"model": {"source": source}}).model.model_name == name
    served = config_from_dict({"model": {"source": source, "served_model_name": "x"}})
    assert served.model.model_name == "x"


def test_kvcache_sizing_rules() -> None:
    assert KVCacheConfig(cpu_bytes="64MiB").cpu_bytes == 64 * 2**20  # type: ignore[arg-type]
    assert KVCacheConfig(num_pages=10).num_pages == 10  # default budgets do not conflict
    assert issues_of({"kvcache": {"num_pages": 10, "cpu_bytes": 1024}}) == [
        "kvcache.cpu_bytes: not allowed together with num_pages (pick one sizing)"
    ]
    assert issues_of({"kvcache": {"page_size": 12, "gpu_memory_fraction": 1.5}}) == [
        "kvcache.page_size: must be a power of two from 1 to 1024, got 12",
        "kvcache.gpu_memory_fraction: must be <= 1, got 1.5",
    ]
    assert KVCacheConfig(page_size=16, max_tokens=33).max_pages == 4  # 3 pages + the null page
    assert KVCacheConfig().max_pages is None


def test_kvcache_pool_ratio() -> None:
    ratio = {"full": 3.0, "swa_32": 1.0}
    assert config_from_dict({"kvcache": {"pool_ratio": ratio}}).kvcache.pool_ratio == ratio
    assert issues_of({"kvcache": {"pool_ratio": {"full": 0}}}) == [
        "kvcache.pool_ratio: shares must be > 0, got <= 0 for ['full']"
    ]
    assert issues_of({"kvcache": {"pool_ratio": {}}}) == [
        "kvcache.pool_ratio: must name at least one pool group, or be left out"
    ]
    assert issues_of({"kvcache": {"num_pages": 10, "pool_ratio": {"full": 1}}}) == [
        "kvcache.pool_ratio: splits a memory budget; with num_pages every group gets num_pages "
        "pages (pick one sizing)"
    ]
    assert issues_of({"kvcache": {"num_pages": 10, "max_tokens": 64}}) == [
        "kvcache.max_tokens: caps a memory budget; with num_pages it would not apply"
    ]


def test_kvcache_host_tier_bytes() -> None:
    """kvcache.host_tier_bytes: bytes or a unit; >= 0; needs prefix reuse (below one page per
    group is refused at worker start-up: tests/worker_common/test_engine_setup.py); not with
    tensor-parallel workers yet."""
    assert KVCacheConfig().host_tier_bytes == 0
    assert KVCacheConfig(host_tier_bytes="1GiB").host_tier_bytes == 2**30  # type: ignore[arg-type]
    assert issues_of({"kvcache": {"host_tier_bytes": -1}}) == [
        "kvcache.host_tier_bytes: must be a byte count (an integer, or a number with a unit like "
        "'512MiB'), got -1"
    ]
    assert issues_of({"kvcache": {"host_tier_bytes": "1GiB", "reuse_policy": "none"}}) == [
        "kvcache.host_tier_bytes: needs prefix reuse (with reuse_policy 'none' no page is ever "
        "reusable, so nothing would go to the host tier): set reuse_policy, or 0"
    ]
    tp = {"tensor_parallel_size": 2}
    assert issues_of({"kvcache": {"host_tier_bytes": "1GiB"}, "decode": tp, "prefill": tp}) == [
        "kvcache.host_tier_bytes: not supported with tensor parallelism yet (ranks 1.. hold their "
        "KV heads in processes the host tier does not copy): decode.tensor_parallel_size 2, "
        "prefill.tensor_parallel_size 2; use 0"
    ]
    aggregated = {"prefill": {"replicas": 0, **tp}, "kvcache": {"host_tier_bytes": "1GiB"}}
    assert config_from_dict(aggregated).kvcache.host_tier_bytes == 2**30  # no prefill workers


def test_kvcache_swa_scratch_reuse() -> None:
    assert KVCacheConfig().swa_scratch_reuse is False
    assert KVCacheConfig(swa_scratch_reuse=True).swa_scratch_reuse is True
    assert issues_of({"kvcache": {"swa_scratch_reuse": "sometimes"}})


def test_one_request_must_fit_the_kv_cache() -> None:
    data = {"model": {"max_model_len": 100}, "kvcache": {"max_tokens": 99}}
    assert issues_of(data) == [
        "kvcache.max_tokens: must be >= model.max_model_len (100) so one request fits, got 99",
    ]
    data = {"model": {"max_model_len": 100}, "kvcache": {"num_pages": 7}}
    assert issues_of(data) == [
        "kvcache.num_pages: must be >= 8 (model.max_model_len 100 in pages of 16, plus the null "
        "page) so one request fits, got 7",
    ]
    assert config_from_dict({"model": {"max_model_len": 100}, "kvcache": {"num_pages": 8}})


def test_chunks_hold_whole_pages() -> None:
    assert issues_of({"kvcache": {"page_size": 32}, "transfer": {"staging_tokens": 1000}}) == [
        "transfer.staging_tokens: must be a multiple of kvcache.page_size (32), got 1000"
    ]


def test_transfer_rules_and_ucx_environment() -> None:
    transfer = TransferConfig(
        ucx_tls=["tcp", "cuda_copy", "cuda_ipc"],  # type: ignore[arg-type]
        ucx_net_devices="lo",
        ucx_env={"UCX_RNDV_THRESH": "8192"},
    )
    assert transfer.ucx_environment == {
        "UCX_RNDV_THRESH": "8192",
        "UCX_TLS": "tcp,cuda_copy,cuda_ipc",
        "UCX_NET_DEVICES": "lo",
    }
    assert TransferConfig().ucx_environment == {}
    data = {
        "transfer": {
            "host": "10.0.0.1",
            "interface": "eth0",
            "lease_s": 5,
            "ucx_tls": ["tcp", "CUDA"],
            "ucx_env": {"UCX_TLS": "tcp", "OMP_NUM_THREADS": "1"},
        }
    }
    assert issues_of(data) == [
        "transfer.ucx_tls: transport names are lower-case words like 'tcp' or 'cuda_ipc', got ['CUDA']",
        "transfer.ucx_env: keys must start with 'UCX_', got ['OMP_NUM_THREADS']",
    ]
    data = {"transfer": {"host": "10.0.0.1", "interface": "eth0", "lease_s": 5}}
    assert issues_of(data) == [
        "transfer.interface: not allowed together with host (pick one)",
        "transfer.lease_s: must be >= connect_deadline_s and pull_deadline_s (30.0): a shorter "
        "lease can expire while the decode worker is still within its deadline, got 5.0",
    ]
    assert config_from_dict({"transfer": {"interface": "eth0"}}).transfer.interface == "eth0"


def test_transfer_settings_that_would_validate_and_then_fail() -> None:
    # Each of these used to pass validation and then fail (or quietly degrade) at run time.
    def issue(**transfer: object) -> list[str]:
        return issues_of({"transfer": transfer})

    assert "must include 'tcp'" in issue(ucx_tls=["sm"])[0]  # peer error handling drops sm
    assert "first name only" in issue(ucx_tls=["tcp", "^sm"])[0]
    # UCX only warns about a transport it does not know: a typo would quietly drop cuda_ipc.
    assert issue(ucx_tls=["tcp", "cuda_ipcc"]) == [
        "transfer.ucx_tls: not UCX transports: 'cuda_ipcc' (did you mean 'cuda_ipc'?); UCX would "
        "only warn and run without them"
    ]
    assert "'tcpp' (did you mean 'tcp'?)" in issue(ucx_tls=["tcpp", "^shmm"])[0]
    for fine in (["^sm"], ["all"], ["tcp", "cuda", "gdr_copy"], ["tcp", "some_new_transport"]):
        assert config_from_dict({"transfer": {"ucx_tls": fine}}).transfer.ucx_tls == tuple(fine)
    assert "an address they can dial" in issue(host="0.0.0.0")[0]  # advertised in tickets
    got = config_from_dict({"transfer": {"ucx_env": {"UCX_MAX_RNDV_RAILS": 1, "UCX_X": True}}})
    assert got.transfer.ucx_env == {"UCX_MAX_RNDV_RAILS": "1", "UCX_X": "y"}  # YAML scalars
    tuned = config_from_dict(
        {"transfer": {"staging_buffers": 2, "progress_mode": "thread-polling"}}
    ).transfer
    assert (tuned.staging_buffers, tuned.progress_mode) == (2, "thread-polling")
    two = {"prefill": {"replicas": 2}, "transfer": {"port": 5555}}
    assert "cannot all listen on port 5555" in issues_of(two)[0]  # the second failed to bind
    two["ray"] = {"address": "auto"}  # a cluster of nodes: one per node may share the port
    assert config_from_dict(two).transfer.port == 5555
    ranks = {"prefill": {"tensor_parallel_size": 4}, "transfer": {"port": 65533}}
    assert "would listen on 65536 (port + rank)" in issues_of(ranks)[0]  # rank 3
    ranks["transfer"]["port"] = 65532
    assert config_from_dict(ranks).transfer.port == 65532


def test_transfer_secret_failure_policy_and_fault_injection() -> None:
    t = config_from_dict(
        {
            "transfer": {
                "secret": "s3cret",
                "on_failure": "recompute",
                "fault_injection": {"fraction": 0.1, "points": ["connect", "mid_data"], "seed": 4},
            }
        }
    ).transfer
    assert t.secret is not None and t.secret.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(t) and "s3cret" not in str(t.model_dump(mode="json"))
    assert (t.on_failure, t.fault_injection.fraction, t.fault_injection.points) == (
        "recompute",
        0.1,
        ("connect", "mid_data"),
    )
    assert config_from_dict({}).transfer.fault_injection.fraction == 0.0  # off by default
    assert issues_of({"transfer": {"on_failure": "retry"}})[0].startswith("transfer.on_failure")
    assert issues_of({"transfer": {"fault_injection": {"fraction": 2}}})[0].startswith(
        "transfer.fault_injection.fraction"
    )
    assert issues_of({"transfer": {"fault_injection": {"points": ["nowhere"]}}})[0].startswith(
        "transfer.fault_injection.points"
    )


def test_prefix_aware_routing_needs_reuse() -> None:
    for policy in ("prefix_aware", "kv_aware"):
        data = {"router": {"policy": policy}, "kvcache": {"reuse_policy": "none"}}
        assert issues_of(data) == [
            f"router.policy: '{policy}' needs prefix reuse: kvcache.reuse_policy must be one of "
            "'all_reusable', 'per_request', got 'none'"
        ]


def test_router_policies_and_the_local_prefill_threshold() -> None:
    config = config_from_dict({"router": {"policy": "kv_aware", "local_prefill_max_tokens": 64}})
    assert config.router.policy == "kv_aware" and config.router.uses_kv_events
    assert config.router.local_prefill_max_tokens == 64
    assert not config_from_dict({}).router.uses_kv_events  # load_balance, threshold 0
    assert config_from_dict({"router": {"local_prefill_max_tokens": 1}}).router.uses_kv_events
    issues = issues_of({"router": {"policy": "cache_aware", "local_prefill_max_tokens": -1}})
    assert issues[0].startswith(
        "router.policy: must be one of 'round_robin', 'load_balance', 'prefix_aware', 'kv_aware'"
    )
    assert issues[1] == "router.local_prefill_max_tokens: must be >= 0, got -1"
    assert issues_of({"prefill": {"replicas": 0}, "router": {"local_prefill_max_tokens": 8}}) == [
        "router.local_prefill_max_tokens: only means something with prefill workers "
        "(prefill.replicas is 0: every request is prefilled on its decode worker already); "
        "leave it 0"
    ]
    no_reuse = {"router": {"local_prefill_max_tokens": 8}, "kvcache": {"reuse_policy": "none"}}
    assert issues_of(no_reuse) == [
        "router.local_prefill_max_tokens: needs prefix reuse on the decode workers: "
        "kvcache.reuse_policy must be one of 'all_reusable', 'per_request', got 'none'"
    ]


def test_server_and_stats() -> None:
    config = config_from_dict(
        {"server": {"api_key": "s3cret", "port": 0}, "stats": {"max_stats_len": -1}}
    )
    assert config.server.api_key is not None
    assert config.server.api_key.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(config)
    assert issues_of({"server": {"api_key": ""}}) == [
        "server.api_key: must not be empty (an empty key would turn authentication off)"
    ]
    assert issues_of({"stats": {"max_stats_len": -2, "interval_s": 0}}) == [
        "stats.max_stats_len: must be >= -1, got -2",
        "stats.interval_s: must be > 0, got 0",
    ]
