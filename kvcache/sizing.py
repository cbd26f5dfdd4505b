"""How many pages each pool group gets, from a memory budget.

The arithmetic is pure (numbers in, numbers out) so it is tested on any machine; only
``cuda_free_bytes`` asks the device. Typical use on CUDA, after the weights are loaded and one
profiling forward pass measured the activation peak:

    budget = device_kv_budget(cuda_free_bytes(dev), fraction=0.9, weights_bytes=0, activation_peak_bytes=peak)
    need = pages_per_request(templates, max_model_len, prefill_chunk_size)
    specs = size_pool_groups(templates, budget, need, max_requests=max_num_seqs)
    check_one_request_fits(specs, need, max_model_len)

and on CPU ``size_pool_groups(templates, cpu_budget_bytes, ...)``. Without ``pool_ratios`` the budget
splits by each group's bytes per token times the tokens one request holds there: max_model_len in a
full-attention group, about window + chunk in a sliding-window group.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from kvcache.sliding_window import max_pages_held
from kvcache.spec import PoolGroupSpec


class CudaMemory(NamedTuple):
    """A CUDA device's memory at one moment, in bytes."""

    free: int
    total: int
    torch_reserved: int
    """held by this process's torch allocator"""


def cuda_free_bytes(device: torch.device | str) -> int:
    """Free memory of a CUDA device now, in bytes (``torch.cuda.mem_get_info``)."""
    return cuda_memory(device).free


def cuda_memory(device: torch.device | str) -> CudaMemory:
    """The device's free and total memory and what this process's torch allocator holds, now."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"cuda_memory needs a CUDA device, got {device}")
    free, total = torch.cuda.mem_get_info(device)
    return CudaMemory(int(free), int(total), int(torch.cuda.memory_reserved(device)))


def non_torch_growth(before: CudaMemory, now: CudaMemory) -> int:
    """Device memory taken since ``before`` outside torch's allocator (CUDA libraries' workspaces
    and modules, NCCL's buffers): what left the free pool less what torch's allocator grew by. As
    vLLM's profiling, it is charged to the engine: the free pool cannot tell whose it is, and an
    engine that ignored it would take more than its share."""
    return max(0, (before.free - now.free) - (now.torch_reserved - before.torch_reserved))


def device_kv_budget(
    free_bytes: int, fraction: float, weights_bytes: int = 0, activation_peak_bytes: int = 0
) -> int:
    """KV budget in bytes: ``fraction`` of what stays free once weights and activations are in place.

    Args:
        free_bytes: free device memory when measured.
        fraction: share of the remaining memory given to the KV cache, in (0, 1].
        weights_bytes: weights still to be loaded after ``free_bytes`` was measured (0 when measured
            after loading).
        activation_peak_bytes: peak activation memory of the largest forward pass.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if min(free_bytes, weights_bytes, activation_peak_bytes) < 0:
        raise ValueError("byte counts must be >= 0")
    remaining = free_bytes - weights_bytes - activation_peak_bytes
    if remaining <= 0:
        raise ValueError(
            f"no memory left for the KV cache: free {free_bytes} B - weights {weights_bytes} B "
            f"- activation peak {activation_peak_bytes} B = {remaining} B"
        )
    return int(remaining * fraction)


def check_share_left(total_bytes: int, left_bytes: int, utilization: float) -> int:
    """The engine's share of the device in bytes, ``utilization`` of ``total_bytes``. As vLLM,
    a share past what other processes left it (``left_bytes``: free, plus what the engine holds)
    is refused, not cut down; engine/kv_setup.memory_at_start asks before the weights load."""
    share = int(total_bytes * utilization)
    if left_bytes < share:
        gib = 1 << 30
        raise ValueError(
            f"gpu_memory_utilization={utilization} asks for {share / gib:.2f} GiB of this GPU's "
            f"{total_bytes / gib:.2f} GiB, but only {left_bytes / gib:.2f} GiB "
            "were left by other processes: lower gpu_memory_utilization, or free the GPU"
        )
    return share


def utilization_kv_budget(
    total_bytes: int,
    free_bytes: int,
    used_bytes: int,
    utilization: float,
    activation_peak_bytes: int = 0,
    non_torch_bytes: int = 0,
) -> int:
    """KV budget in bytes under vLLM's ``gpu_memory_utilization``: the engine may take
    ``utilization`` of the device's ``total_bytes`` in all; it holds ``used_bytes`` already in
    torch's allocator (its weights, loaded) and ``non_torch_bytes`` outside it (non_torch_growth
    since it started), and needs ``activation_peak_bytes`` more for a step; the KV cache gets the
    rest. As vLLM, an engine whose share is more than other processes left it (``free_bytes``
    now, plus what it holds) is refused, not given less than it asked for."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    if min(total_bytes, free_bytes, used_bytes, activation_peak_bytes, non_torch_bytes) < 0:
        raise ValueError("byte counts must be >= 0")
    used_bytes += non_torch_bytes
    share = check_share_left(total_bytes, free_bytes + used_bytes, utilization)
    budget = share - used_bytes - activation_peak_bytes
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache under gpu_memory_utilization={utilization}: "
            f"{utilization} of {total_bytes} B is {share} B, the engine holds {used_bytes} B, a "
            f"step needs about {activation_peak_bytes} B more, and {free_bytes} B are free; "
            "raise gpu_memory_utilization"
        )
    return budget


class KVSizingError(ValueError):
    """A KV cache that cannot be sized as asked. ``setting`` names what the caller should change:
    ``"pool_ratio"``, ``"budget"`` (the memory budget or the page count) or ``"host_tier_bytes"``."""

    def __init__(self, setting: str, message: str) -> None:
        self.setting = setting
        super().__init__(message)


def pages_per_request(
    templates: list[PoolGroupSpec], max_model_len: int, max_step_tokens: int
) -> dict[str, int]:
    """Group -> the most pages one request of ``max_model_len`` tokens holds there at once, when a
    step computes at most ``max_step_tokens`` (the prefill chunk): its whole context in a full
    group, about (window + chunk) / page_size in a window group (kvcache/sliding_window.py)."""
    return {
        t.name: max_pages_held(max_model_len, t.page_size, t.sliding_window, max_step_tokens)
        for t in templates
    }


def budget_shares(
    templates: list[PoolGroupSpec],
    request_pages: dict[str, int],
    pool_ratios: dict[str, float] | None = None,
) -> dict[str, float]:
    """How the budget splits between groups: ``pool_ratios`` when given (it must name exactly the
    groups, each share > 0), else each group's bytes per token times the tokens one request holds
    there (``request_pages``), so that every group fits the same number of longest requests."""
    names = [t.name for t in templates]
    if pool_ratios is None:
        return {t.name: float(t.page_bytes * request_pages[t.name]) for t in templates}
    unknown = sorted(set(pool_ratios) - set(names))
    missing = sorted(set(names) - set(pool_ratios))
    if unknown or missing:
        said = f"names {unknown}, which the model does not have" if unknown else ""
        lacks = f"lacks {missing}" if missing else ""
        raise KVSizingError(
            "pool_ratio",
            f"pool_ratio {' and '.join(x for x in (said, lacks) if x)}; the model's pool groups "
            f"are {names}",
        )
    bad = sorted(g for g, r in pool_ratios.items() if not r > 0)
    if bad:
        raise KVSizingError("pool_ratio", f"pool_ratio shares must be > 0, got <= 0 for {bad}")
    return dict(pool_ratios)


def split_budget(
    budget_bytes: int, page_bytes: dict[str, int], shares: dict[str, float]
) -> dict[str, int]:
    """Pages per group (null page included) when group g gets ``shares[g] / sum(shares)`` of the
    bytes."""
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    if any(b <= 0 for b in page_bytes.values()):
        raise ValueError(f"page sizes in bytes must be > 0, got {page_bytes}")
    total = sum(shares.values())
    return {g: int(budget_bytes * shares[g] / total) // page_bytes[g] for g in page_bytes}


def cap_pages_by_tokens(num_pages: int, max_tokens: int | None, page_size: int) -> int:
    """Cap pages (null page included) so usable pages hold at most ``max_tokens`` tokens, rounded up."""
    if max_tokens is None:
        return num_pages
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    return min(num_pages, -(-max_tokens // page_size) + 1)


def size_pool_groups(
    templates: list[PoolGroupSpec],
    budget_bytes: int,
    request_pages: dict[str, int],
    *,
    max_requests: int | None = None,
    max_tokens: int | None = None,
    pool_ratios: dict[str, float] | None = None,
) -> list[PoolGroupSpec]:
    """The templates with ``num_pages`` set from the budget (their own ``num_pages`` is ignored).

    Args:
        templates: one spec per group; everything but ``num_pages`` is final.
        budget_bytes: bytes for all KV storage, null pages included.
        request_pages: group -> pages one longest request holds there (``pages_per_request``).
        max_requests: cap: no group gets more than this many longest requests' pages.
        max_tokens: cap on the tokens any group holds (None: no cap).
        pool_ratios: optional byte split between groups (``budget_shares``).

    Raises KVSizingError when a group would get fewer than 2 pages (null page + one usable), or
    for a bad ``pool_ratios``.
    """
    shares = budget_shares(templates, request_pages, pool_ratios)
    pages = split_budget(budget_bytes, {t.name: t.page_bytes for t in templates}, shares)
    sized: list[PoolGroupSpec] = []
    for t in templates:
        n = cap_pages_by_tokens(pages[t.name], max_tokens, t.page_size)
        if max_requests is not None:
            n = min(n, max_requests * request_pages[t.name] + 1)
        if n < 2:
            raise KVSizingError(
                "pool_ratio" if pool_ratios is not None else "budget",
                f"pool group {t.name!r}: a budget of {budget_bytes} B gives it {n} pages of "
                f"{t.page_bytes} B; need at least 2 (the null page and one usable page)",
            )
        sized.append(dataclasses.replace(t, num_pages=n))
    return sized


def check_one_request_fits(
    specs: list[PoolGroupSpec], request_pages: dict[str, int], max_model_len: int
) -> None:
    """Raise KVSizingError unless every group holds one request of ``max_model_len`` tokens."""
    short = [s for s in specs if s.usable_pages < request_pages[s.name]]
    if short:
        detail = "; ".join(
            f"group {s.name!r} has {s.usable_pages} usable pages, one request needs "
            f"{request_pages[s.name]}"
            for s in short
        )
        raise KVSizingError(
            "budget",
            f"one request of max_model_len={max_model_len} tokens cannot fit: {detail}. Give the "
            "KV cache more memory or pages, lower max_model_len, or shift pool_ratio toward "
            "those groups",
        )


def host_pages_per_group(specs: list[PoolGroupSpec], host_bytes: int) -> dict[str, int]:
    """Host-tier pages per group: ``host_bytes`` split as the device pools split their bytes (each
    group's pages times its page bytes), so every group keeps about the same multiple of its
    device pool. Raises KVSizingError ("host_tier_bytes") when some group would get no page."""
    if host_bytes <= 0:
        raise ValueError(f"host_bytes must be > 0, got {host_bytes}")
    device_bytes = {s.name: s.usable_pages * s.page_bytes for s in specs}
    pages = split_budget(host_bytes, {s.name: s.page_bytes for s in specs}, device_bytes)
    short = [s for s in specs if pages[s.name] < 1]
    if short:
        detail = ", ".join(f"{s.name!r} gets {pages[s.name]} of {s.page_bytes} B" for s in short)
        raise KVSizingError(
            "host_tier_bytes",
            f"the host tier (host_tier_bytes {host_bytes} B) holds less than one page in some pool "
            f"group ({detail}); "
            "give it at least one page per group, or 0 to turn it off",
        )
    return pages
