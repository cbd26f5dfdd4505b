"""KVCacheManager: allocation, freeing, storage views, stats and integrity (reuse: test_manager_reuse.py)."""

import pytest
import torch

from kvcache.manager import KVCacheManager
from kvcache.reuse_policy import ReusePolicy
from tests.kvcache.conftest import MakeManager, group_spec


def test_allocate_grows_by_whole_pages_in_order(make_manager: MakeManager) -> None:
    m = make_manager(num_pages=6, page_size=2)
    assert m.allocate_slots("r1", 5)
    assert m.page_ids("r1") == {"full": [1, 2, 3]}
    assert m.allocate_slots("r1", 6)  # still fits in 3 pages
    assert m.page_ids("r1") == {"full": [1, 2, 3]}
    assert m.allocate_slots("r1", 7)
    assert m.page_ids("r1") == {"full": [1, 2, 3, 4]}
    assert m.allocate_slots("r1", 2)  # never shrinks
    assert m.page_ids("r1") == {"full": [1, 2, 3, 4]}
    assert m.num_free_pages("full") == 1


def test_zero_tokens_registers_request_without_pages(make_manager: MakeManager) -> None:
    m = make_manager()
    assert m.allocate_slots("r", 0)
    assert m.has_request("r") and m.page_ids("r") == {"full": []}
    with pytest.raises(ValueError, match="num_total_tokens"):
        m.allocate_slots("r", -1)


def test_all_or_nothing(make_manager: MakeManager) -> None:
    m = make_manager(num_pages=6, page_size=2)
    assert m.allocate_slots("r1", 6)  # [1, 2, 3]
    before = m.stats()
    assert not m.allocate_slots("r2", 6)  # needs 3, 2 free
    assert not m.has_request("r2")
    with pytest.raises(KeyError, match="r2"):
        m.page_ids("r2")
    assert not m.allocate_slots("r1", 12)  # growth beyond capacity: r1 keeps what it had
    assert m.page_ids("r1") == {"full": [1, 2, 3]}
    assert m.stats() == before
    assert m.allocate_slots("r2", 4)
    assert m.page_ids("r2") == {"full": [4, 5]}
    assert m.num_free_pages("full") == 0


def test_free_returns_pages_and_unknown_free_is_noop(make_manager: MakeManager) -> None:
    m = make_manager(num_pages=6, page_size=2)
    m.allocate_slots("r1", 4)  # [1, 2]
    m.allocate_slots("r2", 2)  # [3]
    m.free("r1")
    m.free("r1")  # late free
    m.free("never-seen")
    assert not m.has_request("r1")
    assert m.num_free_pages("full") == 4
    # Unregistered pages go back to the head, first page first.
    assert m.allocate_slots("r3", 6)
    assert m.page_ids("r3") == {"full": [1, 2, 4]}


def test_allocate_after_free_starts_a_fresh_request(make_manager: MakeManager) -> None:
    m = make_manager(num_pages=6, page_size=2)
    m.allocate_slots("r", 6)
    m.free("r")
    assert m.allocate_slots("r", 2)
    assert m.page_ids("r") == {"full": [1]}


def test_stats_and_peak_reset(make_manager: MakeManager) -> None:
    m = make_manager(ReusePolicy.ALL_REUSABLE, num_pages=6, page_size=2)
    m.allocate_slots("a", 6)  # [1, 2, 3]
    m.commit("a", [7, 7, 8, 8, 9, 9], 6, prompt_done=True)
    m.allocate_slots("b", 4)  # [4, 5]
    s = m.stats().groups["full"]
    assert (s.total, s.free, s.used, s.evictable, s.peak_used) == (5, 0, 5, 0, 5)
    m.free("a")
    s = m.stats().groups["full"]
    assert (s.free, s.used, s.evictable, s.peak_used) == (3, 2, 3, 5)
    m.reset_peak()
    assert m.stats().groups["full"].peak_used == 2
    m.allocate_slots("c", 2)  # evicts page 3 (a's last page, freed first)
    s = m.stats().groups["full"]
    assert m.page_ids("c") == {"full": [3]}
    assert (s.free, s.used, s.evictable, s.peak_used, s.evictions) == (2, 3, 2, 3, 1)
    assert m.stats().num_requests == 2


def test_layer_cache_views_are_the_buffers(make_manager: MakeManager) -> None:
    groups = [group_spec("a", (0, 2), num_pages=4), group_spec("b", (1,), num_pages=4)]
    m = make_manager(groups=groups)
    assert set(m.buffers) == {"a", "b"}
    assert tuple(m.buffers["a"].shape) == (4, 1, 2, 2, 2, 2)  # [pages, Hkv, layers, 2, ps, D]
    assert torch.count_nonzero(m.buffers["a"]) == 0
    k, v = m.layer_cache(2)
    assert tuple(k.shape) == (4, 2, 1, 2)  # [num_pages, page_size, Hkv, D]
    k[3, 1] = 1.0
    v[3, 0] = 2.0
    assert torch.equal(m.buffers["a"][3, :, 1, 0, 1], torch.ones(1, 2))
    assert torch.equal(m.buffers["a"][3, :, 1, 1, 0], torch.full((1, 2), 2.0))
    assert int(torch.count_nonzero(m.buffers["a"])) == 4
    kb, _ = m.layer_cache(1)
    assert kb.data_ptr() == m.buffers["b"].data_ptr()
    with pytest.raises(KeyError, match="layer 3"):
        m.layer_cache(3)


def test_several_groups_allocate_in_lockstep(make_manager: MakeManager) -> None:
    groups = [group_spec("a", (0,), num_pages=6), group_spec("b", (1,), num_pages=3)]
    m = make_manager(groups=groups)
    assert m.allocate_slots("r", 3)
    assert m.page_ids("r") == {"a": [1, 2], "b": [1, 2]}
    assert not m.allocate_slots("q", 2)  # "a" has room, "b" has none: nothing taken anywhere
    assert m.num_free_pages("a") == 3 and m.num_free_pages("b") == 0


@pytest.mark.parametrize(
    ("groups", "error", "match"),
    [
        ([], ValueError, "at least one"),
        ([group_spec("a", (0,)), group_spec("a", (1,))], ValueError, "unique"),
        ([group_spec("a", (0,)), group_spec("b", (0,))], ValueError, "more than one pool group"),
        (
            [group_spec("a", (0,), page_size=2), group_spec("b", (1,), page_size=4)],
            ValueError,
            "page_size",
        ),
    ],
)
def test_bad_specs_are_refused(groups: list, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        KVCacheManager(groups, ReusePolicy.NONE, "cpu")


def test_reuse_policy_accepts_strings(make_manager: MakeManager) -> None:
    assert make_manager("per_request").reuse_policy is ReusePolicy.PER_REQUEST


def test_check_integrity_reports_broken_accounting(make_manager: MakeManager) -> None:
    m = make_manager(num_pages=6, page_size=2)
    m.allocate_slots("r", 4)
    m._requests["r"].pages["full"].append(5)  # a page the pool never gave out
    with pytest.raises(RuntimeError, match="page 5 has ref count 0 but 1 holders"):
        m.check_integrity()
    m._requests["r"].pages["full"].pop()
    m._pools["full"].peak_used = 0
    with pytest.raises(RuntimeError, match="peak used 0 below current usage 2"):
        m.check_integrity()
    m.reset_peak()


@pytest.mark.parametrize("host_pages", [None, 4])
def test_a_dropped_manager_frees_its_buffers_without_the_garbage_collector(
    host_pages: int | None,
) -> None:
    """No reference cycle keeps a manager alive: its device memory goes when its last reference
    does (a cycle made an engine built after a dropped one size a small cache on a GPU)."""
    import gc
    import weakref

    spec = group_spec(num_pages=6, page_size=2)
    manager = KVCacheManager(
        [spec],
        ReusePolicy.ALL_REUSABLE,
        torch.device("cpu"),
        False,
        {"full": host_pages} if host_pages else None,
    )
    manager.allocate_slots("a", 6)  # evictions and the host tier's hooks in place
    manager.free("a")
    alive = weakref.ref(manager)
    gc.disable()
    try:
        del manager
        assert alive() is None
    finally:
        gc.enable()
