from collections import Counter
from collections.abc import Callable

import pytest

from kvcache.page_pool import PagePool
from tests.kvcache.conftest import TrackedPool

MakePool = Callable[[int], TrackedPool]


def test_fresh_pool_hands_out_pages_in_order_never_the_null_page(make_pool: MakePool) -> None:
    t = make_pool(5)
    assert t.pool.num_usable == 4 and t.pool.num_free == 4 and t.pool.num_used == 0
    assert t.allocate(2) == [1, 2]
    assert t.allocate(2) == [3, 4]
    assert t.pool.num_free == 0 and t.pool.num_used == 4
    with pytest.raises(RuntimeError, match="only 0 free"):
        t.pool.allocate(1)


def test_too_large_allocation_changes_nothing(make_pool: MakePool) -> None:
    t = make_pool(4)
    with pytest.raises(RuntimeError):
        t.pool.allocate(4)
    assert t.pool.free_order() == [1, 2, 3]


def test_plain_free_pages_are_reused_before_cached_ones(make_pool: MakePool) -> None:
    t = make_pool(6)
    a = t.allocate(3)  # [1, 2, 3]
    assert t.pool.register(a[0], 100)
    t.free(a)
    # 2 and 3 were never registered: they go to the head; 1 is evictable at the tail.
    assert t.pool.free_order() == [3, 2, 4, 5, 1]
    assert t.pool.num_evictable == 1
    assert t.allocate(4) == [3, 2, 4, 5]
    assert t.pool.lookup(100) == 1  # still cached


def test_lru_eviction_order_and_hash_dropped(make_pool: MakePool) -> None:
    t = make_pool(4)
    pages = t.allocate(3)
    for p, h in zip(pages, [10, 20, 30], strict=True):
        assert t.pool.register(p, h)
    t.free([pages[1]])
    t.free([pages[2]])
    t.free([pages[0]])
    assert t.pool.free_order() == [2, 3, 1]
    assert t.pool.num_evictable == 3
    assert t.allocate(1) == [2]
    assert t.pool.lookup(20) is None and t.pool.page_hash(2) is None
    assert t.pool.num_evictions == 1 and t.pool.num_evictable == 2


def test_touch_takes_evictable_page_out_of_queue_and_refreshes_lru(make_pool: MakePool) -> None:
    t = make_pool(4)
    pages = t.allocate(2)  # [1, 2]
    t.pool.register(1, 11)
    t.pool.register(2, 22)
    t.free([1])
    t.free([2])
    assert t.pool.free_order() == [3, 1, 2]
    t.touch(1)
    assert t.pool.ref_count(1) == 1 and 1 not in t.pool.free_order()
    assert t.pool.num_evictable == 1
    t.free([1])
    assert t.pool.free_order() == [3, 2, 1]  # 1 now most recently used
    assert pages == [1, 2]


def test_shared_page_needs_every_holder_to_free(make_pool: MakePool) -> None:
    t = make_pool(3)
    (p,) = t.allocate(1)
    t.pool.register(p, 5)
    t.touch(p)
    assert t.pool.ref_count(p) == 2
    t.free([p])
    assert t.pool.ref_count(p) == 1 and t.pool.num_free == 1
    t.free([p])
    assert t.pool.num_free == 2 and t.pool.num_evictable == 1


def test_register_rules(make_pool: MakePool) -> None:
    t = make_pool(4)
    a, b = t.allocate(2)
    assert t.pool.register(a, 1)
    assert t.pool.register(a, 1)  # idempotent
    assert not t.pool.register(b, 1)  # hash already owned by a: b stays unregistered
    assert t.pool.page_hash(b) is None and t.pool.lookup(1) == a
    with pytest.raises(RuntimeError, match="cannot re-register"):
        t.pool.register(a, 2)
    with pytest.raises(RuntimeError, match="only a held page"):
        t.pool.register(3, 9)


def test_misuse_raises(make_pool: MakePool) -> None:
    t = make_pool(3)
    with pytest.raises(ValueError, match="not a usable page"):
        t.pool.free([0])
    with pytest.raises(RuntimeError, match="ref count 0"):
        t.pool.free([1])
    with pytest.raises(RuntimeError, match="registered"):
        t.pool.touch(1)
    with pytest.raises(ValueError, match="num_pages must be >= 2"):
        PagePool(1)


def test_integrity_detects_wrong_holders() -> None:
    pool = PagePool(4)
    pool.allocate(1)
    with pytest.raises(RuntimeError, match="page 1 has ref count 1 but 0 holders"):
        pool.check_integrity(Counter())
    pool.check_integrity(Counter({1: 1}))


def test_integrity_detects_corrupted_index() -> None:
    pool = PagePool(4)
    (p,) = pool.allocate(1)
    pool.register(p, 7)
    pool._index[8] = p  # a second hash pointing at the same page
    with pytest.raises(RuntimeError, match="index maps"):
        pool.check_integrity(Counter({p: 1}))


def test_integrity_detects_touched_null_page() -> None:
    pool = PagePool(3)
    pool._ref_counts[0] = 1
    with pytest.raises(RuntimeError, match="null page"):
        pool.check_integrity(Counter())
