"""How many pages each pool group gets, from a memory budget.

The arithmetic is pure (numbers in, numbers out) so it is tested on any machine; only
``cuda_free_bytes`` asks the device. Typical use on CUDA, after the weights are loaded and one
profiling forward pass measured the activation peak:

    budget = device_kv_budget(cuda_free_bytes(dev), fraction=0.9, weights_bytes=0, activation_peak_bytes=peak)
    specs = size_pool_groups(templates, budget, max_tokens=max_model_len * max_num_seqs)

and on CPU ``size_pool_groups(templates, cpu_budget_bytes, ...)``.
"""

from __future__ import annotations

import dataclasses

import torch

from kvcache.spec import PoolGroupSpec


def cuda_free_bytes(device: torch.device | str) -> int:
    """Free memory of a CUDA device now, in bytes (``torch.cuda.mem_get_info``)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"cuda_free_bytes needs a CUDA device, got {device}")
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


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


def split_budget(
    budget_bytes: int, page_bytes: dict[str, int], pool_ratios: dict[str, float] | None
) -> dict[str, int]:
    """Pages per group (null page included) that fit in ``budget_bytes``.

    Without ratios every group gets the same number of pages (what full-attention groups need, since
    a request holds as many pages in each). With ratios, group g gets ``ratio_g / sum(ratios)`` of
    the bytes.
    """
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    if any(b <= 0 for b in page_bytes.values()):
        raise ValueError(f"page sizes in bytes must be > 0, got {page_bytes}")
    if pool_ratios is None:
        pages = budget_bytes // sum(page_bytes.values())
        return {g: pages for g in page_bytes}
    if set(pool_ratios) != set(page_bytes):
        raise ValueError(
            f"pool_ratios must name exactly the groups {sorted(page_bytes)}, got {sorted(pool_ratios)}"
        )
    if any(r <= 0 for r in pool_ratios.values()):
        raise ValueError(f"pool ratios must be > 0, got {pool_ratios}")
    total = sum(pool_ratios.values())
    return {g: int(budget_bytes * pool_ratios[g] / total) // page_bytes[g] for g in page_bytes}


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
    max_tokens: int | None = None,
    pool_ratios: dict[str, float] | None = None,
) -> list[PoolGroupSpec]:
    """The templates with ``num_pages`` set from the budget (their own ``num_pages`` is ignored).

    Args:
        templates: one spec per group; everything but ``num_pages`` is final.
        budget_bytes: bytes for all KV storage, null pages included.
        max_tokens: cap on tokens the cache must ever hold (None: no cap).
        pool_ratios: optional byte split between groups (see ``split_budget``).

    Raises ValueError when a group would get fewer than 2 pages (null page + one usable).
    """
    page_bytes = {t.name: t.page_bytes for t in templates}
    pages = split_budget(budget_bytes, page_bytes, pool_ratios)
    sized: list[PoolGroupSpec] = []
    for t in templates:
        n = cap_pages_by_tokens(pages[t.name], max_tokens, t.page_size)
        if n < 2:
            raise ValueError(
                f"pool group {t.name!r}: budget of {budget_bytes} B gives {n} pages of {t.page_bytes} B; "
                "need at least 2 (the null page and one usable page)"
            )
        sized.append(dataclasses.replace(t, num_pages=n))
    return sized
