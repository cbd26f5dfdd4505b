"""The cluster configuration: pydantic models of the cluster YAML, validated once at the edge.

``load_config(path)`` is the entry point; every model is frozen and rejects unknown keys. The
sections live one per module: model, workers (prefill/decode pools), kv_cache, transfer, serving
(router, server, stats, ray); cluster_config holds the checks that span sections.
"""

from cluster.config.cluster_config import ClusterConfig
from cluster.config.kv_cache import KVCacheConfig
from cluster.config.loader import ConfigError, config_from_dict, load_config
from cluster.config.model import DEFAULT_SOURCE, EMBEDDED_MODEL_NAME, DummyModelConfig, ModelConfig
from cluster.config.serving import RayConfig, RouterConfig, ServerConfig, StatsConfig
from cluster.config.transfer import TransferConfig
from cluster.config.workers import (
    DecodePoolConfig,
    PrefillPoolConfig,
    SchedulerLimits,
    WorkerResources,
)

__all__ = [
    "DEFAULT_SOURCE",
    "EMBEDDED_MODEL_NAME",
    "ClusterConfig",
    "ConfigError",
    "DecodePoolConfig",
    "DummyModelConfig",
    "KVCacheConfig",
    "ModelConfig",
    "PrefillPoolConfig",
    "RayConfig",
    "RouterConfig",
    "SchedulerLimits",
    "ServerConfig",
    "StatsConfig",
    "TransferConfig",
    "WorkerResources",
    "config_from_dict",
    "load_config",
]
