"""Checks of a cluster config against what the YAML does not hold: the model's shape and the Ray
nodes. ``build_cluster`` runs them before it starts any actor, so a tensor_parallel_size the model
cannot split, or that no node can host, is a ConfigError naming the fields, not a worker that
fails to start."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cluster.config import ClusterConfig, ConfigError
from cluster.config.workers import PoolConfig
from engine.model_config import ModelConfig
from engine.tp.partition import tp_problems

SOURCE = "cluster config (checked against the model and the Ray nodes)"


def pools_in_use(config: ClusterConfig) -> list[tuple[str, PoolConfig]]:
    """(section name, pool) of the pools that will have workers."""
    pools: list[tuple[str, PoolConfig]] = [("decode", config.decode)]
    if not config.aggregated:
        pools.insert(0, ("prefill", config.prefill))
    return pools


def tensor_parallel_issues(config: ClusterConfig, model: ModelConfig) -> list[str]:
    """One line per pool whose tensor_parallel_size the model cannot be split by."""
    return [
        f"{name}.tensor_parallel_size: {problem}"
        for name, pool in pools_in_use(config)
        for problem in tp_problems(model, pool.tensor_parallel_size)
    ]


def placement_issues(config: ClusterConfig, nodes: Sequence[Mapping[str, float]]) -> list[str]:
    """One line per pool whose ranks (``tensor_parallel_size`` bundles of its resources, packed on
    one node) no node of ``nodes`` (each node's total resources) can hold."""
    issues = []
    for name, pool in pools_in_use(config):
        tp = pool.tensor_parallel_size
        if tp == 1:
            continue  # one actor: Ray places it where it fits, or reports that nothing fits
        need = {resource: amount * tp for resource, amount in pool.resources.bundle.items()}
        if any(all(node.get(r, 0.0) >= a for r, a in need.items()) for node in nodes):
            continue
        largest = max(nodes, key=lambda n: (n.get("GPU", 0.0), n.get("CPU", 0.0)), default={})
        have = {r: largest.get(r, 0.0) for r in need}
        what = "resources.num_gpus" if "GPU" in need else "resources.num_cpus"
        issues.append(
            f"{name}.tensor_parallel_size: {tp} ranks need {_amounts(need)} on one node (each "
            f"rank {name}.{what} and the rest of {name}.resources), but the largest node has "
            f"{_amounts(have)}"
        )
    return issues


def _amounts(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in sorted(resources.items()))


def preflight(config: ClusterConfig, model: ModelConfig | None = None) -> None:
    """Raise ConfigError listing every problem of ``config`` with its model (read from its source
    when not given) and the connected Ray cluster's live nodes."""
    if model is None:
        from engine.loaders import read_model_config

        dummy = config.model.dummy_config
        try:
            model = read_model_config(
                config.model.source,
                config.model.load_format,
                dummy.as_hf_dict() if dummy is not None else None,
            )
        except ValueError as e:
            if dummy is None:
                raise
            raise ConfigError(SOURCE, [f"model.dummy_config: {e}"]) from None
    issues = tensor_parallel_issues(config, model)
    if not issues and any(pool.tensor_parallel_size > 1 for _, pool in pools_in_use(config)):
        issues += placement_issues(config, ray_node_resources())
    if issues:
        raise ConfigError(SOURCE, issues)


def ray_node_resources() -> list[dict[str, float]]:
    """The total resources of each live node of the connected Ray cluster."""
    import ray

    nodes: list[dict[str, Any]] = ray.nodes()
    return [dict(n["Resources"]) for n in nodes if n.get("Alive")]
