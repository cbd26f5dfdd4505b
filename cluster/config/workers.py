"""The ``prefill`` and ``decode`` sections: how many workers, where they run, how they schedule."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from cluster import label_selector
from cluster.config.base import Section, check_fields

# Ray's built-in resources have their own fields; as custom resources they would be counted twice.
_BUILTIN_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


class WorkerResources(Section):
    """What Ray reserves for each worker of a pool, and which nodes may host it."""

    num_cpus: float = Field(
        1.0,
        ge=0,
        description=(
            "CPUs Ray reserves per rank (a worker of tensor_parallel_size N reserves N times this "
            "on one node); on CPU also the torch threads each rank runs."
        ),
    )
    num_gpus: float = Field(
        0.0,
        ge=0,
        description=(
            "GPUs per rank: 0 on CPU, 1 for a rank of its own; a fraction below 1 shares a GPU "
            "with other workers (not with the worker's own ranks: tensor_parallel_size above 1 "
            "needs 0 or 1), and the worker then takes at most that share of the GPU's memory "
            "times kvcache.gpu_memory_fraction. A worker of tensor_parallel_size N uses N GPUs of "
            "one node."
        ),
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description=(
            'Custom Ray resources per rank, e.g. {"prefill_node": 1}: a worker of '
            "tensor_parallel_size N reserves N times each (one bundle per rank)."
        ),
    )
    label_selector: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Ray node label selector: the nodes that may host the pool's workers, e.g. "
            '{"ray.io/accelerator-type": "H200"}. Per label a value v, !v (not v, or no such '
            "label), in(a,b) or !in(a,b) (no spaces), as Ray matches them. Checked against the "
            "live nodes before any worker starts: a selector that no node (or too few for the "
            "replicas) can meet is refused."
        ),
    )

    @field_validator("num_gpus")
    @classmethod
    def _one_gpu_per_rank(cls, value: float) -> float:
        if value > 1:
            raise ValueError(
                f"must be <= 1: a rank runs on one GPU (for more GPUs per worker, raise "
                f"tensor_parallel_size), got {value:g}"
            )
        return value

    @field_validator("label_selector")
    @classmethod
    def _ray_selector(cls, value: dict[str, str]) -> dict[str, str]:
        found = label_selector.problems(value)
        if found:
            raise ValueError("; ".join(found))
        return value

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, value: dict[str, float]) -> dict[str, float]:
        builtin = sorted(_BUILTIN_RESOURCES.intersection(value))
        if builtin:
            raise ValueError(
                f"built-in resources {builtin} go in num_cpus / num_gpus, not in resources"
            )
        negative = sorted(name for name, amount in value.items() if amount < 0)
        if negative:
            raise ValueError(f"amounts must be >= 0, negative for {negative}")
        return value

    @property
    def ray_actor_options(self) -> dict[str, Any]:
        """Keyword arguments for ``ActorClass.options(...)`` of one rank."""
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            options["resources"] = dict(self.resources)
        if self.label_selector:
            options["label_selector"] = dict(self.label_selector)
        return options

    @property
    def bundle(self) -> dict[str, float]:
        """One rank's placement-group bundle (its resources, zero amounts left out)."""
        amounts = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {name: amount for name, amount in amounts.items() if amount > 0}


class SchedulerLimits(Section):
    """Per-step limits of a worker's scheduler (vLLM's names)."""

    max_num_seqs: int = Field(
        64,
        gt=0,
        description=(
            "Most requests computing at once (running, or loading from the host tier); "
            "prefilled requests beyond it wait, their pages held, for a place."
        ),
    )
    max_num_batched_tokens: int = Field(
        2048,
        gt=0,
        description=(
            "Most tokens (prompt chunks + decode tokens) in one step; at least max_num_seqs, "
            "so that every running request can decode each step (vLLM refuses less too)."
        ),
    )
    prefill_chunk_size: int = Field(
        512,
        gt=0,
        description=(
            "Most prompt tokens of one request in one step (chunked prefill). vLLM lets a lone "
            "prefill take the whole max_num_batched_tokens: set the two equal for that."
        ),
    )

    @model_validator(mode="after")
    def _chunk_fits_step(self) -> SchedulerLimits:
        budget = self.max_num_batched_tokens
        problems = []
        if self.prefill_chunk_size > budget:
            problems.append(
                (
                    "prefill_chunk_size",
                    f"must be <= max_num_batched_tokens ({budget}), got {self.prefill_chunk_size}",
                )
            )
        if budget < self.max_num_seqs:
            problems.append(
                (
                    "max_num_batched_tokens",
                    f"must be >= max_num_seqs ({self.max_num_seqs}), got {budget}: the "
                    "requests past it in the running list would get no token in a step",
                )
            )
        if problems:
            check_fields(problems)
        return self


class PoolConfig(Section):
    """One pool of identical workers."""

    resources: WorkerResources = Field(
        default_factory=WorkerResources, description="Ray resources per rank of each worker."
    )
    scheduler: SchedulerLimits = Field(
        default_factory=SchedulerLimits, description="Scheduler limits of each worker."
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description=(
            "Ranks per worker (tensor parallelism): each holds 1/N of the weights and of every KV "
            "page's heads, all on one node (a placement group). N must divide the model's query "
            "heads and its MLP width; its KV heads must divide by N, or N by them (KV heads then "
            "replicated). Checked against the model before any worker starts."
        ),
    )

    @model_validator(mode="after")
    def _ranks_own_their_gpus(self) -> PoolConfig:
        gpus = self.resources.num_gpus
        if self.tensor_parallel_size > 1 and 0 < gpus < 1:
            check_fields(
                [
                    (
                        "resources.num_gpus",
                        f"must be 0 or 1 with tensor_parallel_size {self.tensor_parallel_size} "
                        f"(each rank needs a GPU of its own), got {gpus}",
                    )
                ]
            )
        return self

    @property
    def num_ranks(self) -> int:
        return self.tensor_parallel_size


class PrefillPoolConfig(PoolConfig):
    """Prefill workers: run prompts and hand the KV cache to a decode worker."""

    replicas: int = Field(
        1,
        ge=0,
        description="Prefill workers; 0 = aggregated mode (decode workers prefill locally).",
    )
    prefill_deadline_s: float = Field(
        300.0,
        gt=0,
        description=(
            "Longest a prefill worker works on one prompt (queue and prefill) before it aborts it "
            "and tells the router, which retries on another prefill worker (router.prefill_retries)."
        ),
    )


class DecodePoolConfig(PoolConfig):
    """Decode workers: receive the KV cache and generate; in aggregated mode they prefill too."""

    replicas: int = Field(1, ge=1, description="Decode workers (at least one).")
    page_wait_deadline_s: float = Field(
        60.0,
        gt=0,
        description=(
            "Longest a transferred request waits for free KV pages on a decode worker before it "
            "fails with an error naming this field. It stops waiting sooner when the prefill "
            "worker's lease on its KV (transfer.lease_s) ends first: the request then fails as a "
            "failed transfer does, or is prefilled on the decode worker (transfer.on_failure)."
        ),
    )
    token_deadline_s: float = Field(
        300.0,
        gt=0,
        description=(
            "Longest a decode worker waits for a request's next token (its first, when it "
            "prefills locally) before it aborts the request with an error."
        ),
    )
