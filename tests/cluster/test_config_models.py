"""The config sections' own rules: defaults, bounds, cross-field checks, derived values."""

from __future__ import annotations

import pydantic
import pytest
from pydantic import BaseModel

from cluster.config import (
    ClusterConfig,
    DummyModelConfig,
    WorkerResources,
    config_from_dict,
)
from tests.cluster.conftest import issues_of

TINY_DUMMY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "max_position_embeddings": 256,
}


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


def test_a_step_must_hold_a_token_for_every_running_request() -> None:
    """A budget under max_num_seqs left the requests past it in the running list without a
    token, step after step, their pages held (vLLM refuses it too)."""
    data = {"prefill": {"scheduler": {"max_num_seqs": 256, "max_num_batched_tokens": 128,
                                      "prefill_chunk_size": 128}}}  # fmt: skip
    assert issues_of(data) == [
        "prefill.scheduler.max_num_batched_tokens: must be >= max_num_seqs (256), got 128: the "
        "requests past it in the running list would get no token in a step"
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
