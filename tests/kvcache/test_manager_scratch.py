"""SWA scratch reuse: a prefill rewrites its out-of-window window pages in place, never commits
them, and so leaves no trail of cached pages; what reuse loses with it on.

Groups: "full" (layer 0) and "swa_4" (layer 1, window 4), pages of 2 tokens, 16 pages each.
"""

import pytest

from kvcache.manager import KVCacheManager
from kvcache.reuse_policy import ReusePolicy
from tests.kvcache.conftest import MakeManager, group_spec

from .test_manager_windows import TOKENS, prefill


def hybrid(make: MakeManager, scratch: bool, policy=ReusePolicy.ALL_REUSABLE) -> KVCacheManager:
    groups = [
        group_spec("full", (0,), num_pages=16, page_size=2),
        group_spec("swa_4", (1,), num_pages=16, page_size=2, sliding_window=4),
    ]
    return make(policy, groups=groups, swa_scratch_reuse=scratch)


def test_scratch_pages_are_rewritten_in_place(make_manager: MakeManager) -> None:
    m = hybrid(make_manager, scratch=True)
    pool = m._pools["swa_4"]
    seen: list[list[int]] = []
    done = 0
    for end in (4, 8, 12, 16, 20):
        assert m.allocate_slots("a", end, num_computed_tokens=done)
        done = end
        m.commit("a", TOKENS, done, prompt_done=done == 20)
        seen.append(m.page_ids("a")["swa_4"])
        if done < 20:  # never committed before the prompt is done
            assert all(pool.page_hash(p) is None for p in range(1, 16))
    assert seen == [
        [1, 2],
        [1, 2, 3, 4],
        [0, 0, 3, 4, 1, 2],  # positions 0, 1 left the window: their pages hold positions 4, 5
        [0, 0, 0, 0, 1, 2, 3, 4],
        [0, 0, 0, 0, 0, 0, 3, 4, 1, 2],
    ]
    s = m.stats().groups["swa_4"]
    # Four pages ever touched: (window - 1 + chunk) / page_size rounded up; nothing left cached.
    assert (s.peak_used, s.peak_evictable, s.free_low_water) == (4, 0, 11)
    # The prompt's last window was committed when the prompt was done.
    assert all(pool.page_hash(p) is not None for p in (3, 4, 1, 2))
    assert m.stats().groups["full"].used == 10


def test_without_scratch_the_prefill_leaves_cached_pages(make_manager: MakeManager) -> None:
    m = hybrid(make_manager, scratch=False)
    prefill(m, "a", TOKENS[:20], chunk=4)
    assert m.page_ids("a")["swa_4"] == [0, 0, 0, 0, 0, 0, 7, 8, 9, 10]
    s = m.stats().groups["swa_4"]
    assert (s.used, s.evictable, s.peak_evictable, s.free_low_water) == (4, 6, 6, 5)


def test_what_scratch_reuse_loses(make_manager: MakeManager) -> None:
    """A later request sharing only the first 9 tokens of a 20-token prompt: without scratch reuse
    it hits 8 of them; with it, the window pages of positions 2 and 3 were overwritten, so it
    recomputes from the start. Continuing the whole prompt hits either way."""
    shared = TOKENS[:9] + [1, 1, 1]
    whole = TOKENS[:20] + [1]
    for scratch, partial_hit in ((False, 8), (True, 0)):
        m = hybrid(make_manager, scratch=scratch)
        prefill(m, "a", TOKENS[:20], chunk=4)
        assert m.match_prefix(shared).num_tokens == partial_hit
        assert m.match_prefix(whole).num_tokens == 20
        m.free("a")
        assert m.match_prefix(whole).num_tokens == 20


def test_shared_and_cached_pages_are_never_rewritten(make_manager: MakeManager) -> None:
    m = hybrid(make_manager, scratch=True)
    prefill(m, "a", TOKENS[:8], chunk=8)  # prompt done: all 4 window pages committed
    match = m.match_prefix(TOKENS[:20])
    assert match.page_ids["swa_4"] == [0, 0, 3, 4]  # a hit at 8: positions 2, 3
    assert m.allocate_slots("b", 12, match)
    assert m.allocate_slots("b", 16, num_computed_tokens=12)
    # Positions 2, 3 (a's pages 3, 4, shared and cached) left b's window: released, not rewritten.
    assert m.page_ids("b")["swa_4"] == [0, 0, 0, 0, 5, 6, 7, 8]
    assert m._pools["swa_4"].ref_count(3) == 1  # a still holds it
    assert m.allocate_slots("b", 20, num_computed_tokens=16)
    # Positions 4, 5 (b's own, unregistered) are rewritten as positions 8, 9.
    assert m.page_ids("b")["swa_4"] == [0, 0, 0, 0, 0, 0, 7, 8, 5, 6]


def test_decode_releases_instead_of_rewriting(make_manager: MakeManager) -> None:
    m = hybrid(make_manager, scratch=True)
    prefill(m, "a", TOKENS[:8], chunk=8)
    tokens = TOKENS[:8] + [1, 2, 3, 4]
    for computed in range(8, 12):  # four decode steps: one token each
        assert m.allocate_slots("a", computed + 1, num_computed_tokens=computed)
        m.commit("a", tokens, computed + 1, prompt_done=True)
    # The query at 11 reads 8..11: pages of positions 0..3 were released as evictable (committed
    # at the end of the prompt), not rewritten; positions 4 and 5 got fresh pages.
    assert m.page_ids("a")["swa_4"] == [0, 0, 0, 0, 5, 6]
    assert m.stats().groups["swa_4"].evictable == 4


@pytest.mark.parametrize("policy", [ReusePolicy.NONE, ReusePolicy.PER_REQUEST])
def test_scratch_with_other_policies(make_manager: MakeManager, policy: ReusePolicy) -> None:
    m = hybrid(make_manager, scratch=True, policy=policy)
    prefill(m, "a", TOKENS[:20], chunk=4)
    assert m.page_ids("a")["swa_4"] == [0, 0, 0, 0, 0, 0, 3, 4, 1, 2]
    assert m.stats().groups["swa_4"].peak_used == 4
