"""The placement of a tensor-parallel worker (cluster/builder.py) on a real local Ray: its ranks'
placement group takes the worker's resources as they are (a rank reserving no CPU got a sliver of
one that its bundle did not have, and never started) and its label selector (it was dropped)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import ray

from cluster.builder import ClusterHandles, _rank0_options
from cluster.config import config_from_dict


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
