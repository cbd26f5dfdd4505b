"""KVCacheManager prefix reuse: match_prefix, commit per policy, hits/misses, eviction, stale matches."""

import dataclasses

import pytest

from kvcache.block_hash import hash_full_pages
from kvcache.kv_events import KVEvent
from kvcache.manager import KVCacheManager
from kvcache.reuse_policy import ReusePolicy
from tests.kvcache.conftest import MakeManager, group_spec

PROMPT = [11, 12, 13, 14, 15]  # page_size 2: two full pages and one partial


def run_prompt(m: KVCacheManager, rid: str, tokens: list[int]) -> None:
    """Admit a request with whatever prefix is cached, 'compute' it, commit it as finished."""
    match = m.match_prefix(tokens)
    assert m.allocate_slots(rid, len(tokens), match)
    m.commit(rid, tokens, len(tokens), prompt_done=True)


def test_match_after_commit_takes_shared_pages(make_manager: MakeManager) -> None:
    m = make_manager(ReusePolicy.ALL_REUSABLE, num_pages=8, page_size=2)
    run_prompt(m, "r1", PROMPT)  # pages [1, 2, 3]; 1 and 2 registered
    match = m.match_prefix(PROMPT + [16, 17])
    assert (match.num_tokens, match.page_ids) == (4, {"full": [1, 2]})
    assert match.block_hashes == hash_full_pages(PROMPT, 2)
    assert m.match_prefix([11, 12, 99, 99, 99]).page_ids == {"full": [1]}
    assert m.match_prefix([99, 12, 13, 14, 15]).num_tokens == 0
    assert m.stats().reuse_queries == 1  # match_prefix alone counts nothing
    assert m.allocate_slots("r2", 7, match)
    assert m.page_ids("r2") == {"full": [1, 2, 4, 5]}
    s = m.stats()
    assert (s.reuse_queries, s.reuse_hit_tokens, s.reuse_miss_tokens) == (2, 4, 8)
    assert s.groups["full"].used == 5
    m.free("r1")
    assert m.stats().groups["full"].used == 4  # pages 1 and 2 still held by r2


def test_match_never_covers_the_whole_prompt(make_manager: MakeManager) -> None:
    m = make_manager(ReusePolicy.ALL_REUSABLE, num_pages=8, page_size=2)
    run_prompt(m, "r1", [1, 2, 3, 4])
    assert (
        m.match_prefix([1, 2, 3, 4]).num_tokens == 2
    )  # last full page dropped: 1 token to compute
    assert m.match_prefix([1, 2, 3, 4, 5]).num_tokens == 4
    assert m.match_prefix([1]).num_tokens == 0
    assert m.match_prefix([]).num_tokens == 0


@pytest.mark.parametrize(
    ("policy", "hit_mid_prompt", "hit_after_done"),
    [(ReusePolicy.NONE, 0, 0), (ReusePolicy.ALL_REUSABLE, 2, 4), (ReusePolicy.PER_REQUEST, 0, 4)],
)
def test_commit_per_policy(
    make_manager: MakeManager, policy: ReusePolicy, hit_mid_prompt: int, hit_after_done: int
) -> None:
    m = make_manager(policy, num_pages=8, page_size=2)
    assert m.allocate_slots("r1", 3)  # first chunk: 3 tokens
    m.commit("r1", PROMPT, 3, prompt_done=False)
    assert m.match_prefix(PROMPT).num_tokens == hit_mid_prompt
    assert m.allocate_slots("r1", 5)
    m.commit("r1", PROMPT, 5, prompt_done=True)
    assert m.match_prefix(PROMPT).num_tokens == hit_after_done
    m.free("r1")
    assert m.stats().groups["full"].evictable == hit_after_done // 2


def test_commit_is_idempotent_and_extends(make_manager: MakeManager) -> None:
    m = make_manager(ReusePolicy.ALL_REUSABLE, num_pages=8, page_size=2)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    m.allocate_slots("r", 4)
    m.commit("r", tokens, 4, prompt_done=False)
    m.commit("r", tokens, 4, prompt_done=False)
    m.commit("r", tokens, 3, prompt_done=False)
    assert m.match_prefix(tokens).page_ids == {"full": [1, 2]}
    m.allocate_slots("r", 7)
    m.commit("r", tokens, 7, prompt_done=True)
    assert m.match_prefix(tokens).page_ids == {"full": [1, 2, 3]}
    m.free("r")
    assert m.stats().groups["full"].evictable == 3


def test_duplicate_content_stays_unregistered(make_manager: MakeManager) -> None:
    m = make_manager(ReusePolicy.ALL_REUSABLE, num_pages=8, page_size=2)
    m.allocate_slots("a", 5)  # [1, 2, 3]
    m.allocate_slots("b", 5)  # [4, 5, 6]: same prompt, computed concurrently, no hit yet
    m.commit("a", PROMPT, 5, prompt_done=True)
    m.commit("b", PROMPT, 5, prompt_done=True)
    assert m.match_prefix(PROMPT + [0]).page_ids == {"full": [1, 2]}
    m.free("b")
    m.free("a")
    s = m.stats().groups["full"]
    assert (s.free, s.evictable) == (7, 2)  # b's copies were plain free, never indexed


def test_evictable_prefix_is_revived_and_lru_evicts_tail_first(make_manager: MakeManager) -> None:
    m = make_manager(ReusePolicy.PER_REQUEST, num_pages=6, page_size=2)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    run_prompt(m, "r1", tokens)  # [1, 2, 3, 4]; 1..3 registered
    m.free("r1")  # queue: 4 (plain, head), 5, then 3, 2, 1 (evictable, tail last-first)
    assert m.allocate_slots("x", 4)
    assert m.page_ids("x") == {"full": [4, 5]}
    assert m.allocate_slots("x", 6)  # evicts page 3: the deepest page of r1's prefix
    assert m.page_ids("x") == {"full": [4, 5, 3]}
    match = m.match_prefix(tokens)
    assert match.page_ids == {"full": [1, 2]}
    assert not m.allocate_slots("r2", 5, match)  # 2 cached + 1 new page, only 2 free
    assert m.allocate_slots("r2", 4, match)
    assert m.page_ids("r2") == {"full": [1, 2]}
    s = m.stats().groups["full"]
    assert (s.free, s.evictable, s.evictions) == (0, 0, 1)


def test_evictable_prefix_pages_count_against_allocation(make_manager: MakeManager) -> None:
    m = make_manager(ReusePolicy.ALL_REUSABLE, num_pages=6, page_size=2)
    run_prompt(m, "r1", [1, 2, 3, 4, 5, 6])
    m.free("r1")  # 5 free pages, 3 of them evictable r1 pages
    long_prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    match = m.match_prefix(long_prompt)
    assert match.num_tokens == 6
    before = (m.stats(), m._pools["full"].free_order())
    assert not m.allocate_slots("r2", 11, match)  # 3 cached + 3 new > 5
    assert (m.stats(), m._pools["full"].free_order()) == before
    assert m.allocate_slots("r2", 10, match)
    assert m.page_ids("r2") == {"full": [1, 2, 3, 4, 5]}


def test_stale_or_inconsistent_prefix_is_refused(make_manager: MakeManager) -> None:
    m = make_manager(ReusePolicy.ALL_REUSABLE, num_pages=4, page_size=2)
    run_prompt(m, "r1", [1, 2, 3, 4, 5])
    m.free("r1")
    match = m.match_prefix([1, 2, 3, 4, 5])
    assert match.num_tokens == 4
    with pytest.raises(ValueError, match="exceeds"):
        m.allocate_slots("r2", 3, match)
    assert m.allocate_slots("other", 6)  # evicts everything
    with pytest.raises(ValueError, match="stale PrefixMatch"):
        m.allocate_slots("r2", 5, match)
    assert not m.has_request("r2")


def test_prefix_ignored_after_first_call(make_manager: MakeManager) -> None:
    m = make_manager(ReusePolicy.ALL_REUSABLE, num_pages=8, page_size=2)
    run_prompt(m, "r1", PROMPT)
    m.allocate_slots("r2", 1)
    assert m.allocate_slots("r2", 5, m.match_prefix(PROMPT))
    assert m.page_ids("r2") == {"full": [4, 5, 6]}
    assert m.stats().reuse_queries == 1


def test_commit_errors(make_manager: MakeManager) -> None:
    m = make_manager(ReusePolicy.ALL_REUSABLE, num_pages=8, page_size=2)
    with pytest.raises(KeyError, match="unknown request"):
        m.commit("ghost", [1, 2], 2, prompt_done=True)
    m.allocate_slots("r", 2)
    with pytest.raises(ValueError, match="outside"):
        m.commit("r", [1, 2], 3, prompt_done=True)
    with pytest.raises(ValueError, match="holds 1"):
        m.commit("r", [1, 2, 3, 4], 4, prompt_done=True)


def test_hit_must_be_in_every_group(make_manager: MakeManager) -> None:
    groups = [group_spec("a", (0,), num_pages=6), group_spec("b", (1,), num_pages=4)]
    m = make_manager(ReusePolicy.ALL_REUSABLE, groups=groups)
    tokens = [1, 2, 3, 4, 5, 6]
    run_prompt(m, "r1", tokens)  # a: [1, 2, 3], b: [1, 2, 3], all registered
    m.free("r1")
    assert m.allocate_slots("x", 2)  # a takes free page 4; b must evict its page 3
    assert m.page_ids("x") == {"a": [4], "b": [3]}
    match = m.match_prefix(tokens + [7])
    assert (match.num_tokens, match.page_ids) == (4, {"a": [1, 2], "b": [1, 2]})
    assert not m.allocate_slots("r2", 7, match)  # "b" lacks room for 2 new pages
    assert m.allocate_slots("r2", 4, match)
    assert m.page_ids("r2") == {"a": [1, 2], "b": [1, 2]}
    assert m.stats().groups["a"].evictable == 1  # a's page 3 is still cached there


def test_an_unrecorded_run_registers_and_counts_nothing(make_manager: MakeManager) -> None:
    m = make_manager(ReusePolicy.ALL_REUSABLE, num_pages=8, page_size=2)
    run_prompt(m, "r1", PROMPT)
    m.free("r1")
    before = m.stats()
    with m.unrecorded():
        run_prompt(m, "warm", [21, 22, 23, 24, 25])
        m.free("warm")
    after = m.stats()
    assert after.groups["full"].peak_used == after.groups["full"].used  # a new peak interval
    assert after.peak_used == 0  # (of every group together too)
    counters = {"groups": {}, "peak_used": 0}
    assert dataclasses.replace(after, **counters) == dataclasses.replace(before, **counters)
    assert (after.groups["full"].used, after.groups["full"].evictable) == (0, 2)
    assert m.match_prefix([21, 22, 23, 24, 25]).num_tokens == 0
    assert m.match_prefix(PROMPT).num_tokens == 4  # what was cached before stays cached
    assert m.reuse_policy is ReusePolicy.ALL_REUSABLE


def test_an_unrecorded_run_must_free_its_requests(make_manager: MakeManager) -> None:
    m = make_manager(ReusePolicy.ALL_REUSABLE, num_pages=8, page_size=2)
    with pytest.raises(RuntimeError, match="warm"), m.unrecorded():
        run_prompt(m, "warm", [21, 22, 23])
    m.free("warm")


def test_reset_prefix_cache_forgets_every_cached_page_only_when_none_is_held(
    make_manager: MakeManager,
) -> None:
    m = make_manager(ReusePolicy.ALL_REUSABLE, num_pages=6, page_size=2)
    m.enable_events()
    run_prompt(m, "r1", PROMPT)  # pages [1, 2, 3]; 1 and 2 registered
    h = hash_full_pages(PROMPT, 2)
    m.drain_events()
    assert not m.reset_prefix_cache()  # r1 holds its pages: nothing changes (vLLM's rule)
    assert m.match_prefix(PROMPT).num_tokens == 4
    assert m.drain_events() == []
    m.free("r1")
    assert m.reset_prefix_cache()
    assert m.match_prefix(PROMPT).num_tokens == 0
    assert m.cached_blocks() == {"full": {"device": []}}
    assert m.drain_events() == [KVEvent("removed", "device", "full", h)]
    s = m.stats().groups["full"]
    assert (s.free, s.evictable, s.used) == (5, 0, 0)
    assert m.allocate_slots("r2", 10)  # every page handed out again, no eviction counted
    assert m.stats().groups["full"].evictions == 0
