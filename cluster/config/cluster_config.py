"""ClusterConfig: the whole cluster YAML, and the checks that span sections."""

from __future__ import annotations

from pydantic import Field, model_validator

from cluster.config.base import Section, check_fields
from cluster.config.kv_cache import KVCacheConfig
from cluster.config.model import ModelConfig
from cluster.config.serving import RayConfig, RouterConfig, ServerConfig, StatsConfig
from cluster.config.transfer import TransferConfig
from cluster.config.workers import DecodePoolConfig, PrefillPoolConfig


class ClusterConfig(Section):
    """One Duet cluster: the model, the two worker pools, and everything between them.

    Every section has defaults, so an empty file is a valid config: the embedded model on CPU,
    one prefill and one decode worker, everything bound to 127.0.0.1.
    """

    model: ModelConfig = Field(default_factory=ModelConfig, description="The model to serve.")
    prefill: PrefillPoolConfig = Field(
        default_factory=PrefillPoolConfig,
        description="Prefill workers (replicas 0 = aggregated: none, the other fields unused).",
    )
    decode: DecodePoolConfig = Field(
        default_factory=DecodePoolConfig, description="Decode workers."
    )
    kvcache: KVCacheConfig = Field(
        default_factory=KVCacheConfig, description="Each worker's paged KV cache."
    )
    transfer: TransferConfig = Field(
        default_factory=TransferConfig,
        description="KV transfer from prefill to decode (unused in aggregated mode: no prefill workers).",
    )
    router: RouterConfig = Field(default_factory=RouterConfig, description="Request routing.")
    server: ServerConfig = Field(
        default_factory=ServerConfig, description="The OpenAI-compatible HTTP server."
    )
    stats: StatsConfig = Field(
        default_factory=StatsConfig, description="Iteration stats and perf metrics."
    )
    ray: RayConfig = Field(default_factory=RayConfig, description="Where the cluster runs.")

    @model_validator(mode="after")
    def _check_across_sections(self) -> ClusterConfig:
        issues: list[tuple[str, str]] = []
        page_size = self.kvcache.page_size
        if self.transfer.port and self.prefill.replicas > 1 and self.ray.starts_local:
            issues.append(
                (
                    "transfer.port",
                    f"{self.prefill.replicas} prefill workers on this one host cannot all listen "
                    f"on port {self.transfer.port}: use 0 (any free port)",
                )
            )
        last_port = self.transfer.port + self.prefill.tensor_parallel_size - 1
        if self.transfer.port and last_port > 65535:
            issues.append(
                (
                    "transfer.port",
                    f"prefill rank {self.prefill.tensor_parallel_size - 1} would listen on "
                    f"{last_port} (port + rank), past 65535",
                )
            )
        if self.transfer.staging_tokens % page_size:
            issues.append(
                (
                    "transfer.staging_tokens",
                    f"must be a multiple of kvcache.page_size ({page_size}), got "
                    f"{self.transfer.staging_tokens}",
                )
            )
        # (Whether one request fits kvcache.num_pages or max_tokens depends on the model's
        # sliding windows: cluster/preflight.py checks it with the model.)
        if self.kvcache.host_tier_bytes:
            pools = [("decode", self.decode)] + (
                [] if self.aggregated else [("prefill", self.prefill)]
            )
            split = [
                f"{name}.tensor_parallel_size {pool.tensor_parallel_size}"
                for name, pool in pools
                if pool.tensor_parallel_size > 1
            ]
            if split:
                issues.append(
                    (
                        "kvcache.host_tier_bytes",
                        "not supported with tensor parallelism yet (ranks 1.. hold their KV heads "
                        f"in processes the host tier does not copy): {', '.join(split)}; use 0",
                    )
                )
        policy = self.router.policy
        if policy in ("prefix_aware", "kv_aware") and self.kvcache.reuse_policy == "none":
            issues.append(
                (
                    "router.policy",
                    f"{policy!r} needs prefix reuse: kvcache.reuse_policy must be one of "
                    "'all_reusable', 'per_request', got 'none'",
                )
            )
        if self.router.local_prefill_max_tokens:
            if self.aggregated:
                issues.append(
                    (
                        "router.local_prefill_max_tokens",
                        "only means something with prefill workers (prefill.replicas is 0: every "
                        "request is prefilled on its decode worker already); leave it 0",
                    )
                )
            elif self.kvcache.reuse_policy == "none":
                issues.append(
                    (
                        "router.local_prefill_max_tokens",
                        "needs prefix reuse on the decode workers: kvcache.reuse_policy must be "
                        "one of 'all_reusable', 'per_request', got 'none'",
                    )
                )
        check_fields(issues)
        return self

    @property
    def aggregated(self) -> bool:
        """True when there are no prefill workers: decode workers prefill locally."""
        return self.prefill.replicas == 0

    @property
    def num_workers(self) -> int:
        return self.prefill.replicas + self.decode.replicas

    @property
    def uses_gpu(self) -> bool:
        """True when any worker that will run asks for a GPU."""
        pools = [self.decode] + ([] if self.aggregated else [self.prefill])
        return any(pool.resources.num_gpus > 0 for pool in pools)
