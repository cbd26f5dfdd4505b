"""Checks of a cluster config against what the YAML does not hold: the model's shape and the Ray
nodes. ``build_cluster`` runs them before it starts any actor, so a tensor_parallel_size the model
cannot split, a worker that no node can host, or a label_selector that no node (or too few) can
meet, is a ConfigError naming the fields, not a worker that fails to start or waits forever to be
placed."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cluster import label_selector
from cluster.config import ClusterConfig, ConfigError
from cluster.config.workers import DecodePoolConfig, PrefillPoolConfig
from engine.kv_setup import kv_pool_templates
from engine.model_config import ModelConfig
from engine.tp.partition import tp_problems
from kvcache.sizing import cap_pages_by_tokens, pages_per_request

SOURCE = "cluster config (checked against the model and the Ray nodes)"


def pools_in_use(config: ClusterConfig) -> list[tuple[str, PrefillPoolConfig | DecodePoolConfig]]:
    """(section name, pool) of the pools that will have workers."""
    pools: list[tuple[str, PrefillPoolConfig | DecodePoolConfig]] = [("decode", config.decode)]
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


def model_length_issues(config: ClusterConfig, model: ModelConfig) -> list[str]:
    """model.max_model_len past the model's positions (every engine would refuse it at start)."""
    asked = config.model.max_model_len
    if asked is None or asked <= model.max_position_embeddings:
        return []
    return [
        f"model.max_model_len: must be <= the model's max_position_embeddings "
        f"({model.max_position_embeddings}), got {asked}"
    ]


def kv_fit_issues(config: ClusterConfig, model: ModelConfig) -> list[str]:
    """kvcache.num_pages and kvcache.max_tokens against one request of max_model_len tokens in
    every pool group of the model, at the pools' largest prefill chunk. A sliding-window group
    holds only about (window + chunk) / page_size of a request's pages: checked against
    max_model_len alone (in the config), they were refused for Mistral-style models the engine
    sizes fine."""
    kv = config.kvcache
    if kv.num_pages is None and kv.max_tokens is None:
        return []
    max_model_len = config.model.max_model_len or model.max_position_embeddings
    templates = kv_pool_templates(model, kv.page_size, torch.float32)
    need = max(
        (
            pages_per_request(templates, max_model_len, pool.scheduler.prefill_chunk_size)
            for _, pool in pools_in_use(config)
        ),
        key=lambda n: max(n.values()),
    )
    most = max(need.values())
    where = (
        f"one request of {max_model_len} tokens (model.max_model_len) holds up to {most} pages "
        f"of {kv.page_size} tokens in a group ({', '.join(f'{g} {n}' for g, n in need.items())})"
    )
    issues = []
    if kv.num_pages is not None and kv.num_pages - 1 < most:
        issues.append(
            f"kvcache.num_pages: must be >= {most + 1}: {where}, plus the null page; "
            f"got {kv.num_pages}"
        )
    capped = kv.max_tokens is not None
    if capped and cap_pages_by_tokens(most + 1, kv.max_tokens, kv.page_size) <= most:
        issues.append(
            f"kvcache.max_tokens: must be >= {(most - 1) * kv.page_size + 1}: {where}; "
            f"got {kv.max_tokens}"
        )
    return issues


@dataclass(frozen=True)
class RayNode:
    """What preflight reads of one live Ray node: its total resources and its labels."""

    resources: Mapping[str, float]
    labels: Mapping[str, str] = field(default_factory=dict)


def placement_issues(
    config: ClusterConfig, nodes: Sequence[RayNode], fixed_nodes: bool = False
) -> list[str]:
    """One line per pool that the live ``nodes`` cannot host: among the nodes its
    ``resources.label_selector`` admits (every node without one), none at all, none that holds
    the ``tensor_parallel_size`` bundles of its resources a worker packs on one node, or (with a
    selector) too few for its replicas, each counted alone. Only what surely cannot be placed is
    refused: the pools may also share nodes, which this does not count, but for ``fixed_nodes``
    (no node will join: every worker of every pool must fit the nodes' resources together).
    Ray would otherwise wait for room that never comes (build_cluster, up to its ready timeout)."""
    issues = []
    for name, pool in pools_in_use(config):
        selector = pool.resources.label_selector
        tp = pool.tensor_parallel_size
        eligible = [n for n in nodes if label_selector.admits(selector, n.labels)]
        where = f"{name}.resources.label_selector {selector}" if selector else ""
        if not eligible:
            issues.append(
                f"{name}.resources.label_selector: {selector} matches no live Ray node (of "
                f"{len(nodes)}: {_labels_seen(nodes, selector)})"
            )
            continue
        need = {resource: amount * tp for resource, amount in pool.resources.bundle.items()}
        room = sum(_workers_fit(n.resources, need, pool.replicas) for n in eligible)
        if room == 0:
            largest = max(
                eligible, key=lambda n: (n.resources.get("GPU", 0.0), n.resources.get("CPU", 0.0))
            )
            have = {r: largest.resources.get(r, 0.0) for r in need}
            node = f"the largest node {f'that {where} matches ' if selector else ''}has"
            what = "resources.num_gpus" if "GPU" in need else "resources.num_cpus"
            issues.append(
                f"{name}.resources: a worker needs {_amounts(need)}, but {node} {_amounts(have)}"
                if tp == 1
                else f"{name}.tensor_parallel_size: {tp} ranks need {_amounts(need)} on one node "
                f"(each rank {name}.{what} and the rest of {name}.resources), but {node} "
                f"{_amounts(have)}"
            )
        elif selector and room < pool.replicas:
            per_worker = f"{_amounts(need)} each" + (f" on one node ({tp} ranks)" if tp > 1 else "")
            issues.append(
                f"{name}.replicas: {pool.replicas} workers need {per_worker}, but the "
                f"{len(eligible)} node(s) that {where} matches hold {room}"
            )
    if fixed_nodes and not issues:
        issues += _total_issues(config, nodes)
    return issues


def _total_issues(config: ClusterConfig, nodes: Sequence[RayNode]) -> list[str]:
    """Every worker of every pool against all the nodes' resources together."""
    asked: Counter[str] = Counter()
    for _, pool in pools_in_use(config):
        for resource, amount in pool.resources.bundle.items():
            asked[resource] += amount * pool.tensor_parallel_size * pool.replicas
    have: Counter[str] = Counter()
    for n in nodes:
        have.update({r: n.resources.get(r, 0.0) for r in asked})
    short = {r: a for r, a in asked.items() if round(a * 10_000) > round(have[r] * 10_000)}
    if not short:
        return []
    per_pool = "; ".join(
        f"{name}: {pool.replicas} x {_amounts(pool.resources.bundle)}"
        + (f" x {pool.tensor_parallel_size} ranks" if pool.tensor_parallel_size > 1 else "")
        for name, pool in pools_in_use(config)
    )
    return [
        f"replicas / resources: the workers need {_amounts(short)} in all ({per_pool}), but "
        f"this Ray's nodes have {_amounts({r: have[r] for r in short})}"
    ]


def _workers_fit(resources: Mapping[str, float], need: Mapping[str, float], most: int) -> int:
    """How many workers needing ``need`` a node of ``resources`` holds alone (``most`` at most).
    In Ray's fixed point (1e-4), so that 1.0 holds ten workers of 0.1 CPU."""
    fits = [
        round(resources.get(r, 0.0) * 10_000) // max(round(amount * 10_000), 1)
        for r, amount in need.items()
    ]
    return min([most, *fits])


def _labels_seen(nodes: Sequence[RayNode], selector: Mapping[str, str]) -> str:
    """The values the nodes have for the selector's keys, e.g. "zone 'a' on 2, none on 1"."""
    parts = []
    for key in sorted(selector):
        seen = Counter(n.labels.get(key) for n in nodes)
        values = ", ".join(
            f"{'none' if value is None else repr(value)} on {count}"
            for value, count in sorted(seen.items(), key=lambda vc: (vc[0] is None, vc[0] or ""))
        )
        parts.append(f"{key} {values}")
    return "; ".join(parts)


def _amounts(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in sorted(resources.items()))


def model_of(config: ClusterConfig) -> ModelConfig:
    """The shape of ``config``'s model (its config only, no weights), or a ConfigError naming
    ``model.source`` (a path that is not there, a file of no model format, a broken checkpoint)
    or ``model.dummy_config``."""
    from engine.loaders import read_model_config

    dummy = config.model.dummy_config
    try:
        return read_model_config(
            config.model.source,
            config.model.load_format,
            dummy.as_hf_dict() if dummy is not None else None,
        )
    except (OSError, ValueError) as e:
        field = "model.dummy_config" if dummy is not None else "model.source"
        raise ConfigError(SOURCE, [f"{field}: {e}"]) from None


def preflight(
    config: ClusterConfig, model: ModelConfig | None = None, fixed_nodes: bool = False
) -> None:
    """Raise ConfigError listing every problem of ``config`` with its model (read from its source
    when not given) and the connected Ray cluster's live nodes. ``fixed_nodes``: the live nodes
    are all there will be (a Ray this process started on this host), so every worker of every
    pool must fit them together."""
    if model is None:
        model = model_of(config)
    import ray

    issues = model_length_issues(config, model)
    issues += tensor_parallel_issues(config, model) + kv_fit_issues(config, model)
    if not issues and ray.is_initialized():  # (no Ray yet: no nodes to place the workers on)
        issues += placement_issues(config, ray_nodes(), fixed_nodes)
    if issues:
        raise ConfigError(SOURCE, issues)


def ray_nodes() -> list[RayNode]:
    """The total resources and the labels of each live node of the connected Ray cluster."""
    import ray

    nodes: list[dict[str, Any]] = ray.nodes()
    return [
        RayNode(dict(n["Resources"]), dict(n.get("Labels") or {})) for n in nodes if n.get("Alive")
    ]
