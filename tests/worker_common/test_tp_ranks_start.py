"""A tensor-parallel cluster worker's ranks at start-up (worker_common/tp_ranks.py, RayRanks): a
rank that dies before it joins rank 0's group is named at once, its actor's error said; rank 0
waited the group's whole timeout (300 s) for it, and the worker's start with it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.engine_config import EngineConfig
from tests.cluster.cluster_fixtures import local_ray
from worker_common.tp_ranks import RayRanks

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", autouse=True)
def ray_local() -> Iterator[None]:
    with local_ray("tp-ranks-start"):
        yield


@ray.remote(num_cpus=0)
class _RankZero:
    """Rank 0 of a worker as far as starting its other ranks goes (the worker actor builds its
    engine around them next)."""

    def start_ranks(self, config: EngineConfig) -> str:
        try:
            ranks = RayRanks(config, 2, "decode-0", 0.5, 0.0, "WARNING")
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        ranks.close()
        return "started"


def test_a_rank_that_dies_before_joining_is_named_at_once(tmp_path: Path) -> None:
    # Rank 1 reads the model's config before it joins the group; with no checkpoint there its
    # process exits (what a rank whose GPU or files fail at start does), and never arrives.
    config = EngineConfig(model=str(tmp_path / "no_checkpoint"), load_format="hf")
    pg = placement_group([{"CPU": 0.5}, {"CPU": 0.5}])
    ray.get(pg.ready(), timeout=60)
    try:
        rank_zero = _RankZero.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
        ).remote()
        said = ray.get(rank_zero.start_ranks.remote(config), timeout=90)
    finally:
        remove_placement_group(pg)
    assert said.startswith("RuntimeError: tensor-parallel rank 1 died at start-up"), said
