"""The placement of a tensor-parallel worker (cluster/builder.py) on a real local Ray: its ranks'
placement group takes the worker's resources as they are (a rank reserving no CPU got a sliver of
one that its bundle did not have, and never started) and its label selector (it was dropped). A
label selector that no node meets is refused before any actor starts (it waited to be placed)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import ray

from cluster.builder import ClusterHandles, _rank0_options, build_cluster
from cluster.config import ConfigError, config_from_dict
from cluster.preflight import preflight


@pytest.fixture(scope="module")
def labelled_ray() -> Iterator[None]:
    """A Ray of our own on 127.0.0.1 whose one node has 4 "slot"s and the label zone=a."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        address="local",
        num_cpus=2,
        resources={"slot": 4},
        labels={"zone": "a"},
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        namespace="duet-test-builder",
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


@ray.remote
class Rank:
    def ping(self) -> str:
        return "ok"


def tp2_worker_options(zone: str) -> tuple[dict, ray.util.placement_group.PlacementGroup]:
    resources = {"num_cpus": 0, "resources": {"slot": 1}, "label_selector": {"zone": zone}}
    config = config_from_dict(
        {"prefill": {"replicas": 0}, "decode": {"tensor_parallel_size": 2, "resources": resources}}
    )
    handles = ClusterHandles(config, None)
    options = _rank0_options(handles, "decode", 0)
    (pg,) = handles.placement_groups
    return options, pg


def test_a_rank_reserving_no_cpu_starts_in_its_bundle(labelled_ray: None) -> None:
    options, pg = tp2_worker_options("a")
    try:
        assert "label_selector" not in options  # (the placement group carries it)
        ray.get(pg.ready(), timeout=30)
        rank = Rank.options(**options).remote()
        assert ray.get(rank.ping.remote(), timeout=30) == "ok"
        ray.kill(rank)
    finally:
        ray.util.remove_placement_group(pg)


def test_the_label_selector_places_the_ranks(labelled_ray: None) -> None:
    _, pg = tp2_worker_options("b")  # no node is in zone b
    try:
        ready, _ = ray.wait([pg.ready()], timeout=3)
        assert not ready
    finally:
        ray.util.remove_placement_group(pg)


def test_a_label_selector_no_node_meets_is_refused_before_any_actor_starts(
    labelled_ray: None,
) -> None:
    """The node's labels are read as Ray reports them (ray.nodes()): zone a, and Ray's own."""
    tiny = {
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 100,
        "max_position_embeddings": 256,
    }  # fmt: skip

    def config(selector: dict[str, str]) -> dict:
        resources = {"num_cpus": 0, "label_selector": selector}
        return {
            "model": {"load_format": "dummy", "dummy_config": tiny},
            "prefill": {"replicas": 0},
            "decode": {"resources": resources},
        }

    with pytest.raises(ConfigError) as caught:  # (a bounded wait, should it start anything)
        build_cluster(config_from_dict(config({"zone": "b"})), ready_timeout_s=20)
    assert caught.value.issues == [
        "decode.resources.label_selector: {'zone': 'b'} matches no live Ray node (of 1: zone 'a' "
        "on 1)"
    ]
    preflight(config_from_dict(config({"zone": "a", "ray.io/node-id": "!x"})))


@ray.remote(num_cpus=0)
class _Worker:
    def close(self) -> None:
        pass

    def ping(self) -> str:
        return "ok"


def test_a_shutdown_that_meets_a_failure_leaves_nothing_else_behind(labelled_ray: None) -> None:
    """One actor Ray cannot kill (here: not an actor at all) does not leave the ones after it,
    the collector or the placement groups running (the first failure ended the shutdown)."""
    from cluster.worker_choice import WorkerSlot

    config = config_from_dict({})
    alive, collector = _Worker.remote(), _Worker.remote()
    ray.get([alive.ping.remote(), collector.ping.remote()], timeout=60)
    pg = ray.util.placement_group([{"slot": 1}])
    ray.get(pg.ready(), timeout=60)
    handles = ClusterHandles(
        config,
        collector,
        prefill=[WorkerSlot("p-0", object())],  # (ray.kill refuses it)
        decode=[WorkerSlot("d-0", alive)],
        placement_groups=[pg],
    )
    handles.shutdown()
    for actor in (alive, collector):
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.ping.remote(), timeout=60)
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"


@ray.remote(num_cpus=0)
class _Unbuildable:
    def __init__(self) -> None:
        raise ValueError("kv_cache: 10 GiB asked,\n2 GiB free")

    def ready(self) -> bool:
        return True


def test_a_worker_whose_constructor_raises_is_named_with_its_error(labelled_ray: None) -> None:
    """`duet serve` prints a worker's failure to start in one line: the exception its constructor
    raised, not Ray's wrapper (a colored call site, pid, actor id and the whole traceback)."""
    from cluster.builder import _root_cause

    actor = _Unbuildable.remote()
    with pytest.raises(ray.exceptions.RayActorError) as caught:
        ray.get(actor.ready.remote(), timeout=60)
    line = _root_cause(caught.value)
    assert line.startswith("ValueError: ") and "2 GiB free" in line
    assert "\x1b" not in line and "Traceback" not in line and "actor_id" not in line
