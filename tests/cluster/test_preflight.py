"""cluster/preflight.py: tensor_parallel_size against the model's shape and the Ray nodes, refused
with ConfigErrors naming the fields before any actor starts."""

from __future__ import annotations

import dataclasses

import pytest
import ray

from cluster.builder import build_cluster
from cluster.config import ConfigError, config_from_dict
from cluster.preflight import (
    RayNode,
    kv_fit_issues,
    placement_issues,
    preflight,
    tensor_parallel_issues,
)
from engine.loaders import read_model_config
from engine.model_config import ModelConfig

EIGHT_HEADS = {  # 8 query heads, 4 KV heads
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 100,
    "max_position_embeddings": 256,
}


def dummy(prefill_tp: int, decode_tp: int, **pools: dict) -> dict:
    return {
        "model": {"load_format": "dummy", "dummy_config": EIGHT_HEADS},
        "prefill": {"tensor_parallel_size": prefill_tp, **pools.get("prefill", {})},
        "decode": {"tensor_parallel_size": decode_tp, **pools.get("decode", {})},
    }


def issues(data: dict) -> list[str]:
    config = config_from_dict(data)
    model = read_model_config("x", "dummy", config.model.dummy_config.as_hf_dict())
    return tensor_parallel_issues(config, model)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_splits_of_8_query_and_4_kv_heads(tp: int) -> None:
    """tp 8 > 4 KV heads: each KV head is replicated on two ranks."""
    assert issues(dummy(tp, tp)) == []


def test_3_ranks_for_8_heads_names_the_field() -> None:
    assert issues(dummy(3, 1)) == [  # (96 splits in 3: the MLP is fine)
        "prefill.tensor_parallel_size: must divide the model's 8 query heads, got 3",
        "prefill.tensor_parallel_size: the model's 4 KV heads must divide by it, or it by them "
        "(KV heads then replicated), got 3",
    ]
    assert issues(dummy(1, 16)) == [
        "decode.tensor_parallel_size: must divide the model's 8 query heads, got 16",
    ]
    wide = dummy(2, 1)
    wide["model"]["dummy_config"] = {**EIGHT_HEADS, "intermediate_size": 97}
    assert issues(wide) == [
        "prefill.tensor_parallel_size: must divide the model's MLP width (intermediate_size 97), "
        "got 2"
    ]


def test_aggregated_mode_checks_only_decode() -> None:
    data = dummy(3, 2)
    data["prefill"]["replicas"] = 0
    assert issues(data) == []


def test_the_embedded_models_9_heads() -> None:
    """SmolLM2-135M: 9 query heads, 3 KV heads, MLP 1536: 3 ranks split it, 2 do not."""
    model = read_model_config("default")
    assert (model.num_heads, model.num_kv_heads, model.intermediate_size) == (9, 3, 1536)
    assert (
        tensor_parallel_issues(config_from_dict({"prefill": {"tensor_parallel_size": 3}}), model)
        == []
    )
    assert tensor_parallel_issues(
        config_from_dict({"decode": {"tensor_parallel_size": 2}}), model
    ) == [
        "decode.tensor_parallel_size: must divide the model's 9 query heads, got 2",
        "decode.tensor_parallel_size: the model's 3 KV heads must divide by it, or it by them (KV "
        "heads then replicated), got 2",
    ]


def test_ranks_of_a_worker_fit_on_one_node() -> None:
    """A worker's tensor_parallel_size ranks are packed on one node: prefill.resources.num_cpus
    (CPUs per rank) times the ranks must fit a node, and so must decode.resources.num_gpus."""
    nodes = [RayNode({"CPU": 2.0}), RayNode({"CPU": 64.0, "GPU": 2.0})]
    cpu = config_from_dict(dummy(4, 1, prefill={"resources": {"num_cpus": 0.5}}))
    assert placement_issues(cpu, nodes) == []
    gpu = config_from_dict(dummy(1, 4, decode={"resources": {"num_cpus": 1, "num_gpus": 1}}))
    assert placement_issues(gpu, nodes) == [
        "decode.tensor_parallel_size: 4 ranks need 4 CPU, 4 GPU on one node (each rank "
        "decode.resources.num_gpus and the rest of decode.resources), but the largest node has "
        "64 CPU, 2 GPU"
    ]
    many = config_from_dict(dummy(8, 1, prefill={"resources": {"num_cpus": 1}}))
    assert placement_issues(many, [RayNode({"CPU": 2.0}), RayNode({"CPU": 4.0})]) == [
        "prefill.tensor_parallel_size: 8 ranks need 8 CPU on one node (each rank "
        "prefill.resources.num_cpus and the rest of prefill.resources), but the largest node has "
        "4 CPU"
    ]


ZONED = [
    RayNode({"CPU": 8.0, "GPU": 1.0}, {"zone": "a"}),
    RayNode({"CPU": 8.0, "GPU": 4.0}, {"zone": "b"}),
    RayNode({"CPU": 64.0}),
]


def zoned(decode_tp: int, replicas: int, selector: dict[str, str], each: float = 1) -> list[str]:
    """The issues of ``replicas`` decode workers of ``decode_tp`` ranks on ZONED, each rank
    reserving ``each`` CPU and GPU."""
    resources = {"num_cpus": each, "num_gpus": each, "label_selector": selector}
    data = dummy(1, decode_tp, decode={"replicas": replicas, "resources": resources})
    return placement_issues(config_from_dict(data), ZONED)


def test_only_the_nodes_a_label_selector_admits_count() -> None:
    """Placed by its label selector (cluster/builder.py), a worker can only go to a node that
    the selector admits: the others' CPUs and GPUs do not count (they did)."""
    assert zoned(1, 1, {"zone": "c"}) == [
        "decode.resources.label_selector: {'zone': 'c'} matches no live Ray node (of 3: zone "
        "'a' on 1, 'b' on 1, none on 1)"
    ]
    assert zoned(4, 1, {"zone": "b"}) == []
    assert zoned(4, 1, {"zone": "!b"}) == [  # zone b has the GPUs; a and the unzoned node not
        "decode.tensor_parallel_size: 4 ranks need 4 CPU, 4 GPU on one node (each rank "
        "decode.resources.num_gpus and the rest of decode.resources), but the largest node that "
        "decode.resources.label_selector {'zone': '!b'} matches has 8 CPU, 1 GPU"
    ]
    assert zoned(1, 5, {"zone": "in(a,b)"}) == []  # 1 + 4 GPUs: five workers fit, a sixth not
    assert zoned(1, 6, {"zone": "in(a,b)"}) == [
        "decode.replicas: 6 workers need 1 CPU, 1 GPU each, but the 2 node(s) that "
        "decode.resources.label_selector {'zone': 'in(a,b)'} matches hold 5"
    ]
    assert zoned(2, 2, {"zone": "b"}) == []  # 2 ranks each: zone b's 4 GPUs hold both
    assert zoned(2, 3, {"zone": "in(a,b)"}) == [
        "decode.replicas: 3 workers need 2 CPU, 2 GPU each on one node (2 ranks), but the 2 "
        "node(s) that decode.resources.label_selector {'zone': 'in(a,b)'} matches hold 2"
    ]
    # Reserving no resource, a worker fits on any node the selector admits, however many.
    assert zoned(1, 50, {"zone": "a"}, each=0) == []


def test_build_cluster_refuses_before_any_actor_starts() -> None:
    """Ray is not even running: the model check fails first."""
    assert not ray.is_initialized()
    with pytest.raises(ConfigError) as caught:
        build_cluster(config_from_dict(dummy(3, 1)))
    assert caught.value.issues[0].startswith("prefill.tensor_parallel_size: must divide")
    assert not ray.is_initialized()
    preflight(config_from_dict(dummy(1, 1)))  # tp 1 everywhere: nothing to ask Ray


def test_an_incomplete_rope_scaling_names_the_field_and_the_missing_key() -> None:
    data = dummy(1, 1)
    data["model"]["dummy_config"] = {**EIGHT_HEADS, "rope_scaling": {"rope_type": "llama3"}}
    with pytest.raises(ConfigError) as err:  # (a bare KeyError('factor') before)
        preflight(config_from_dict(data))
    assert err.value.issues == [
        "model.dummy_config: rope type 'llama3' needs 'factor' in rope_scaling (or "
        "rope_parameters); got ['rope_type']"
    ]


def test_one_request_must_fit_kvcache_num_pages_and_max_tokens() -> None:
    """A full-attention model: one request of max_model_len tokens in whole pages, plus the null
    page."""
    base = dummy(1, 1) | {"model": {**dummy(1, 1)["model"], "max_model_len": 100}}
    hf = config_from_dict(base).model.dummy_config.as_hf_dict()
    model = read_model_config("x", "dummy", hf)

    def fit(kv: dict) -> list[str]:
        return kv_fit_issues(config_from_dict(base | {"kvcache": kv}), model)

    assert fit({"num_pages": 7}) == [
        "kvcache.num_pages: must be >= 8: one request of 100 tokens (model.max_model_len) holds "
        "up to 7 pages of 16 tokens in a group (full 7), plus the null page; "
        "got 7"
    ]
    assert fit({"max_tokens": 96}) == [
        "kvcache.max_tokens: must be >= 97: one request of 100 tokens (model.max_model_len) "
        "holds up to 7 pages of 16 tokens in a group (full 7); got 96"
    ]
    assert fit({"num_pages": 8}) == fit({"max_tokens": 97}) == fit({}) == []


def test_a_sliding_window_model_needs_pages_for_its_window_only() -> None:
    """Every layer windowed (Mistral's shape): a request holds about (window + chunk) / page_size
    pages; checked against max_model_len, a page count the engine sizes fine was refused."""
    data = dummy(1, 1)
    hf = config_from_dict(data).model.dummy_config.as_hf_dict()
    model = ModelConfig.from_hf_config({**hf, "model_type": "mistral", "sliding_window": 32})
    data["model"]["max_model_len"] = 256  # 16 pages of a full-attention group
    for pool in ("prefill", "decode"):
        data[pool]["scheduler"] = {"prefill_chunk_size": 16, "max_num_batched_tokens": 256}
    for kv in ({"num_pages": 6}, {"max_tokens": 64}):
        assert kv_fit_issues(config_from_dict(data | {"kvcache": kv}), model) == [], kv
    tight = config_from_dict(data | {"kvcache": {"num_pages": 3}})
    assert kv_fit_issues(tight, model)[0].startswith("kvcache.num_pages: must be >= ")


def test_a_max_model_len_past_the_models_positions_names_the_field() -> None:
    """Refused before any worker starts (each engine refused it at its start, as
    LLM.max_model_len): a checkpoint's positions are only known from the model."""
    data = dummy(1, 1)
    data["model"]["max_model_len"] = 200
    config = config_from_dict(data)
    model = read_model_config("x", "dummy", config.model.dummy_config.as_hf_dict())
    with pytest.raises(ConfigError) as caught:
        preflight(config, dataclasses.replace(model, max_position_embeddings=128))
    assert caught.value.issues[0] == (
        "model.max_model_len: must be <= the model's max_position_embeddings (128), got 200"
    )
    preflight(config, model)  # (256: fine)
