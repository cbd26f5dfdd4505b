"""Shared factories for kvcache tests: tiny pool groups, and integrity checks at every teardown."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import torch

from kvcache.manager import KVCacheManager
from kvcache.page_pool import PagePool
from kvcache.reuse_policy import ReusePolicy
from kvcache.spec import PoolGroupSpec


def group_spec(
    name: str = "full",
    layer_ids: tuple[int, ...] = (0, 1),
    num_pages: int = 6,
    page_size: int = 2,
    sliding_window: int | None = None,
) -> PoolGroupSpec:
    """A tiny pool group: 1 kv head of dim 2, float32."""
    return PoolGroupSpec(
        name=name,
        layer_ids=layer_ids,
        num_pages=num_pages,
        page_size=page_size,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        sliding_window=sliding_window,
    )


MakeManager = Callable[..., KVCacheManager]


@pytest.fixture
def make_manager() -> Iterator[MakeManager]:
    """``make_manager(policy, num_pages=6, page_size=2, groups=None, swa_scratch_reuse=False,
    host_pages=None)`` (host_pages: host-tier pages of every group); check_integrity at teardown."""
    made: list[KVCacheManager] = []

    def factory(
        policy: ReusePolicy | str = ReusePolicy.ALL_REUSABLE,
        num_pages: int = 6,
        page_size: int = 2,
        groups: list[PoolGroupSpec] | None = None,
        swa_scratch_reuse: bool = False,
        host_pages: int | None = None,
    ) -> KVCacheManager:
        specs = groups or [group_spec(num_pages=num_pages, page_size=page_size)]
        tier = None if host_pages is None else {s.name: host_pages for s in specs}
        manager = KVCacheManager(specs, policy, "cpu", swa_scratch_reuse, tier)
        made.append(manager)
        return manager

    yield factory
    for manager in made:
        manager.check_integrity()


class TrackedPool:
    """A real PagePool plus the test's own record of who holds what, for ``check_integrity``."""

    def __init__(self, num_pages: int) -> None:
        self.pool = PagePool(num_pages)
        self.holders: Counter[int] = Counter()

    def allocate(self, n: int) -> list[int]:
        pages = self.pool.allocate(n)
        self.holders.update(pages)
        return pages

    def touch(self, page_id: int) -> None:
        self.pool.touch(page_id)
        self.holders[page_id] += 1

    def free(self, page_ids: list[int]) -> None:
        self.pool.free(page_ids)
        self.holders.subtract(page_ids)
        self.holders += Counter()  # drop zero entries

    def check(self) -> None:
        self.pool.check_integrity(self.holders)


@pytest.fixture
def make_pool() -> Iterator[Callable[[int], TrackedPool]]:
    """``make_pool(num_pages)`` -> TrackedPool; its integrity is checked at teardown."""
    made: list[TrackedPool] = []

    def factory(num_pages: int) -> TrackedPool:
        tracked = TrackedPool(num_pages)
        made.append(tracked)
        return tracked

    yield factory
    for tracked in made:
        tracked.check()
