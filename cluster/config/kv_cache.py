"""The ``kvcache`` section: page size, how many pages each worker gets, and prefix reuse."""

from __future__ import annotations

from typing import Literal

from pydantic import ByteSize, Field, field_validator, model_validator

from cluster.config.base import Section, check_fields

MAX_PAGE_SIZE = 1024


class KVCacheConfig(Section):
    """Each worker's paged KV cache: one pool group per attention window of the model ("full";
    "swa_<window>" for sliding-window layers). Sizing: ``num_pages`` per group when given, else the
    memory budget of the worker's device (``cpu_bytes`` on CPU, ``gpu_memory_fraction`` on GPU)
    split between the groups (``pool_ratio``), capped by ``max_tokens`` and by what the worker's
    scheduler can use: ``max_num_seqs`` requests of ``model.max_model_len`` tokens (a larger budget
    is not allocated; the start-up log says so). A worker logs its pages per group at start-up and
    refuses to start when one request of ``model.max_model_len`` tokens does not fit in some
    group. ``host_tier_bytes`` adds host memory beneath the pools."""

    page_size: int = Field(
        16, description=f"Tokens per page: a power of two from 1 to {MAX_PAGE_SIZE}."
    )
    num_pages: int | None = Field(
        None,
        ge=2,
        description=(
            "Exact pages per pool group, counting the reserved null page; "
            "excludes cpu_bytes, gpu_memory_fraction, pool_ratio and max_tokens."
        ),
    )
    cpu_bytes: ByteSize = Field(
        ByteSize(512 * 2**20),
        gt=0,
        description=(
            'KV budget of a CPU worker, in bytes or with a unit ("512MiB", "2GiB"); per rank: '
            "each of a tensor-parallel worker's N processes holds this much (its heads' share of "
            "the same pages)."
        ),
    )
    gpu_memory_fraction: float = Field(
        0.9,
        gt=0,
        le=1,
        description=(
            "Fraction of the GPU's free memory (after weights and the activation peak) "
            "given to the KV cache. A worker sharing its GPU (resources.num_gpus below 1) takes "
            "at most num_gpus x this of the GPU's whole memory instead, weights, activations and "
            "KV cache together (vLLM's gpu_memory_utilization): workers starting side by side "
            "each measured the same free memory and took this fraction of it, and ran out."
        ),
    )
    max_tokens: int | None = Field(
        None,
        gt=0,
        description=(
            "Cap on cached tokens per worker, whatever the budget allows (each pool group of a "
            "hybrid model holds at most this many tokens' pages)."
        ),
    )
    reuse_policy: Literal["none", "all_reusable", "per_request"] = Field(
        "all_reusable",
        description=(
            "Prefix reuse: none; all_reusable commits full pages after every prefill chunk; "
            "per_request commits them when the prompt is done."
        ),
    )
    pool_ratio: dict[str, float] | None = Field(
        None,
        description=(
            'Share of the budget per pool group, e.g. {"full": 3, "swa_4096": 1}; normalised; '
            "must name exactly the model's groups (a worker refuses to start otherwise, listing "
            "them). None = each group's bytes per token times the tokens one request holds there "
            "(model.max_model_len in full; window + prefill chunk in a window group)."
        ),
    )
    swa_scratch_reuse: bool = Field(
        False,
        description=(
            "During a long chunked prefill, rewrite the out-of-window pages of sliding-window "
            "groups in place instead of taking new ones: the prefill touches about "
            "(window + chunk) / page_size pages of such a group whatever the prompt length, and "
            "evicts no cached prefixes; a window group then caches only the last window of "
            "each prompt, so a later prompt sharing only part of a long one recomputes it."
        ),
    )
    host_tier_bytes: ByteSize = Field(
        ByteSize(0),
        ge=0,
        description=(
            'Host memory per worker beneath its KV pools ("4GiB"), for reusable pages the device '
            "evicts: they stay findable by prefix hits and are loaded back (pinned memory and a "
            "copy stream on GPU workers). Split between pool groups as the device pools are; a "
            "worker refuses to start when it holds less than one page of some group. 0 = off."
        ),
    )

    @field_validator("page_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value < 1 or value > MAX_PAGE_SIZE or value & (value - 1):
            raise ValueError(f"must be a power of two from 1 to {MAX_PAGE_SIZE}, got {value}")
        return value

    @field_validator("pool_ratio")
    @classmethod
    def _positive_shares(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None:
            if not value:
                raise ValueError("must name at least one pool group, or be left out")
            bad = sorted(name for name, share in value.items() if share <= 0)
            if bad:
                raise ValueError(f"shares must be > 0, got <= 0 for {bad}")
        return value

    @model_validator(mode="after")
    def _one_sizing_rule(self) -> KVCacheConfig:
        issues: list[tuple[str, str]] = []
        if self.num_pages is not None:
            # Only an explicit budget conflicts; the defaults simply do not apply.
            for budget in sorted({"cpu_bytes", "gpu_memory_fraction"} & self.model_fields_set):
                issues.append((budget, "not allowed together with num_pages (pick one sizing)"))
            if self.pool_ratio is not None:
                issues.append(
                    (
                        "pool_ratio",
                        "splits a memory budget; with num_pages every group gets num_pages pages "
                        "(pick one sizing)",
                    )
                )
            if self.max_tokens is not None:
                issues.append(
                    ("max_tokens", "caps a memory budget; with num_pages it would not apply")
                )
        if self.host_tier_bytes and self.reuse_policy == "none":
            issues.append(
                (
                    "host_tier_bytes",
                    "needs prefix reuse (with reuse_policy 'none' no page is ever reusable, so "
                    "nothing would go to the host tier): set reuse_policy, or 0",
                )
            )
        check_fields(issues)
        return self

    @property
    def max_pages(self) -> int | None:
        """The page cap from ``max_tokens``, null page included; None without a cap."""
        if self.max_tokens is None:
            return None
        return -(-self.max_tokens // self.page_size) + 1
