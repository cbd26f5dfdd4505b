"""HostPool: host-tier page accounting on its own: store order, LRU drops, pins, host drops and
skipped stores, with exact page ids."""

from __future__ import annotations

import pytest

from kvcache.host_pool import HostPool, Stored


def check(pool: HostPool, pins: dict[int, int] | None = None) -> None:
    pool.check_integrity(pins or {})


def test_stores_take_free_pages_then_drop_the_least_recently_used() -> None:
    pool = HostPool(2)
    assert pool.store(0xA) == Stored(0, None)
    assert pool.store(0xB) == Stored(1, None)
    assert (pool.lookup(0xA), pool.lookup(0xB), pool.num_free) == (0, 1, 0)
    assert pool.store(0xC) == Stored(0, 0xA)  # A was stored first, never loaded back: a host drop
    assert (pool.lookup(0xA), pool.lookup(0xC), pool.drops, pool.offloaded) == (None, 0, 1, 3)
    pool.touch(1)  # B's device copy was evicted again: B is now the most recently used
    assert pool.drop_order() == [0, 1]
    assert pool.store(0xD) == Stored(0, 0xC)
    assert pool.drops == 2
    check(pool)


def test_a_page_loaded_back_is_not_a_drop_and_is_pinned_until_unpinned() -> None:
    pool = HostPool(2)
    pool.store(0xA)
    pool.store(0xB)
    pool.pin(0)  # a load-back reads A
    assert pool.drop_order() == [1] and pool.num_pinned == 1 and pool.loaded_back == 1
    check(pool, {0: 1})
    assert pool.store(0xC) == Stored(1, 0xB)  # A is pinned: B goes (a drop: never reused)
    assert pool.drops == 1
    assert pool.store(0xD) == Stored(1, 0xC)  # still not A
    pool.unpin(0)
    assert pool.drop_order() == [1, 0]  # A landed: now the most recently used
    assert pool.store(0xE) == Stored(1, 0xD) and pool.drops == 3
    check(pool)


def test_every_page_pinned_skips_the_store() -> None:
    pool = HostPool(1)
    pool.store(0xA)
    pool.pin(0)
    pool.pin(0)  # two load-backs read it
    assert pool.store(0xB) is None and pool.skipped_stores == 1
    assert pool.lookup(0xB) is None and pool.offloaded == 1
    pool.unpin(0)
    assert pool.store(0xB) is None  # still pinned once
    pool.unpin(0)
    assert pool.store(0xB) == Stored(0, 0xA)
    assert pool.drops == 0  # A was loaded back before it was dropped
    assert pool.skipped_stores == 2
    check(pool)


def test_misuse_is_refused() -> None:
    pool = HostPool(2)
    with pytest.raises(ValueError, match="at least one page"):
        HostPool(0)
    with pytest.raises(RuntimeError, match="only a cached page"):
        pool.pin(0)
    with pytest.raises(RuntimeError, match="pin count 0"):
        pool.unpin(0)
    pool.store(0xA)
    with pytest.raises(RuntimeError, match="already in the host tier"):
        pool.store(0xA)
    with pytest.raises(RuntimeError, match="touch needs a cached page"):
        pool.touch(1)
    with pytest.raises(RuntimeError, match="pinned 0 times, 1 loads"):
        pool.check_integrity({0: 1})
