"""KVCacheManager with sliding-window groups: pages released as the window slides, the hybrid prefix
hit, and allocation of only a window's pages (scratch reuse: test_manager_scratch.py).

Every manager here has a full group "full" (layer 0) and a window group "swa_4" (layer 1, a window
of 4 tokens), pages of 2 tokens; the fixture checks integrity after each test.
"""

import pytest

from kvcache.manager import NO_RELEASE, KVCacheManager
from kvcache.reuse_policy import ReusePolicy
from kvcache.spec import NULL_PAGE
from tests.kvcache.conftest import MakeManager, group_spec

TOKENS = list(range(100, 124))


def hybrid(make: MakeManager, policy: ReusePolicy, num_pages: int = 12, **kw) -> KVCacheManager:
    groups = [
        group_spec("full", (0,), num_pages=num_pages, page_size=2),
        group_spec("swa_4", (1,), num_pages=num_pages, page_size=2, sliding_window=4),
    ]
    return make(policy, groups=groups, **kw)


def prefill(m: KVCacheManager, rid: str, tokens: list[int], chunk: int, start: int = 0) -> None:
    """Chunked prefill of ``tokens`` from ``start``: allocate, 'compute', commit, chunk by chunk."""
    done = start
    while done < len(tokens):
        end = min(len(tokens), done + chunk)
        assert m.allocate_slots(rid, end, num_computed_tokens=done)
        done = end
        m.commit(rid, tokens, done, prompt_done=done == len(tokens))


def test_pages_released_as_the_window_slides(make_manager: MakeManager) -> None:
    m = hybrid(make_manager, ReusePolicy.NONE)
    assert m.allocate_slots("r", 6, num_computed_tokens=0)
    assert m.page_ids("r") == {"full": [1, 2, 3], "swa_4": [1, 2, 3]}
    assert m.next_release_at("r") == 5  # from 5 computed tokens the query reads 2.. : page 0 goes
    # Second chunk: its first query (position 6) reads 3..6, so page 0 (tokens 0, 1) is released
    # first and, plain free at the head of the queue, taken again for position 3.
    assert m.allocate_slots("r", 10, num_computed_tokens=6)
    assert m.page_ids("r") == {"full": [1, 2, 3, 4, 5], "swa_4": [NULL_PAGE, 2, 3, 1, 4]}
    # Decode at position 10 reads 7..10: pages 1 and 2 (tokens 2..5) leave the window.
    assert m.allocate_slots("r", 11, num_computed_tokens=10)
    assert m.page_ids("r") == {"full": [1, 2, 3, 4, 5, 6], "swa_4": [0, 0, 0, 1, 4, 3]}
    assert m.next_release_at("r") == 11
    # A decode step inside the same pages: nothing to take, page 3 (tokens 6, 7) leaves at 11.
    assert m.allocate_slots("r", 12, num_computed_tokens=11)
    assert m.page_ids("r")["swa_4"] == [0, 0, 0, 0, 4, 3]
    s = m.stats().groups
    assert (s["full"].used, s["swa_4"].used, s["swa_4"].peak_used) == (6, 2, 4)
    m.free("r")
    assert m.stats().groups["swa_4"].used == 0


def test_without_computed_tokens_nothing_is_released(make_manager: MakeManager) -> None:
    m = hybrid(make_manager, ReusePolicy.NONE)
    assert m.allocate_slots("r", 12)
    assert m.page_ids("r")["swa_4"] == [1, 2, 3, 4, 5, 6]
    assert m.allocate_slots("r", 12, num_computed_tokens=12)
    assert m.page_ids("r")["swa_4"] == [0, 0, 0, 0, 5, 6]
    assert m.allocate_slots("r", 12, num_computed_tokens=2)  # going back changes nothing
    assert m.page_ids("r")["swa_4"] == [0, 0, 0, 0, 5, 6]
    with pytest.raises(ValueError, match="num_computed_tokens=13"):
        m.allocate_slots("r", 12, num_computed_tokens=13)


def test_released_committed_pages_stay_findable(make_manager: MakeManager) -> None:
    m = hybrid(make_manager, ReusePolicy.ALL_REUSABLE)
    prefill(m, "a", TOKENS[:12], chunk=4)
    # chunks end at 4, 8, 12: before the last (query at 8 reads 5..8) pages 0 and 1 were released
    assert m.page_ids("a")["swa_4"] == [0, 0, 3, 4, 5, 6]
    s = m.stats().groups["swa_4"]
    assert (s.used, s.evictable, s.peak_evictable) == (4, 2, 2)
    # A second request with the same 12 tokens and more hits all of them: the full group has every
    # page, and the window group the two pages before the hit (its evictable pages are not needed).
    match = m.match_prefix(TOKENS[:12] + [7])
    assert match.num_tokens == 12
    assert match.page_ids == {"full": [1, 2, 3, 4, 5, 6], "swa_4": [0, 0, 0, 0, 5, 6]}
    # Sharing the first 5 tokens only: the hit at 4 reads released (evictable) window pages 1 and 2.
    match = m.match_prefix(TOKENS[:5] + [7, 7, 7])
    assert match.page_ids == {"full": [1, 2], "swa_4": [1, 2]}
    assert m.allocate_slots("b", 8, match)
    assert m.page_ids("b") == {"full": [1, 2, 7, 8], "swa_4": [1, 2, 7, 8]}
    assert m.stats().groups["swa_4"].evictable == 0
    assert m.stats().reuse_hit_tokens == 4


def test_hit_needs_only_the_window_before_it(make_manager: MakeManager) -> None:
    m = hybrid(make_manager, ReusePolicy.ALL_REUSABLE, num_pages=9)
    prefill(m, "a", TOKENS[:12], chunk=4)
    m.free("a")  # last-first: full queue 7, 8, 6, 5, 4, 3, 2, 1; window 7, 8, 1, 2, 6, 5, 4, 3
    # 4 fresh pages: the plain free 7 and 8, then the oldest cached ones, which are positions 5 and
    # 4 in the full group but the window group's released positions 0 and 1.
    assert m.allocate_slots("x", 8, num_computed_tokens=0)
    assert m.page_ids("x") == {"full": [7, 8, 6, 5], "swa_4": [7, 8, 1, 2]}
    m.free("x")
    # The full group hits 4 pages; the hit at 8 needs window positions 2 and 3 only.
    match = m.match_prefix(TOKENS[:12] + [1])
    assert match.num_tokens == 8
    assert match.page_ids == {"full": [1, 2, 3, 4], "swa_4": [0, 0, 3, 4]}
    assert m.allocate_slots("b", 9, match)
    assert m.page_ids("b") == {"full": [1, 2, 3, 4, 7], "swa_4": [0, 0, 3, 4, 7]}


def test_window_hit_scans_right_to_left(make_manager: MakeManager) -> None:
    groups = [
        group_spec("full", (0,), num_pages=16, page_size=2),
        group_spec("swa_4", (1,), num_pages=12, page_size=2, sliding_window=4),
    ]
    m = make_manager(ReusePolicy.ALL_REUSABLE, groups=groups)
    prefill(m, "a", TOKENS[:12], chunk=4)  # keeps running: window positions 2..5 held
    assert m.page_ids("a")["swa_4"] == [0, 0, 3, 4, 5, 6]
    assert m.match_prefix(TOKENS[:5]).num_tokens == 4  # window positions 0, 1 evictable: a hit
    # 6 fresh window pages: 5 plain free, then page 1 (position 0), the oldest evictable.
    assert m.allocate_slots("x", 12, num_computed_tokens=0)
    assert m.page_ids("x")["swa_4"] == [7, 8, 9, 10, 11, 1]
    # The full group still has every page. A hit at 4 needs window positions 0 and 1: gone; at 8,
    # positions 2 and 3: held by a. A left-to-right scan of the window group would stop at 0.
    assert m.match_prefix(TOKENS[:5]).num_tokens == 0
    match = m.match_prefix(TOKENS[:8] + [1])
    assert match.page_ids == {"full": [1, 2, 3, 4], "swa_4": [0, 0, 3, 4]}
    assert m.match_prefix(TOKENS[:12] + [1]).page_ids["swa_4"] == [0, 0, 0, 0, 5, 6]


def test_prefix_with_later_computed_allocates_only_the_window(make_manager: MakeManager) -> None:
    """A decode worker receiving a prompt: it computes nothing, so it needs only the prompt's last
    window (filled by the transfer) plus the page of the next token."""
    m = hybrid(make_manager, ReusePolicy.ALL_REUSABLE)
    prefill(m, "a", TOKENS[:6], chunk=6)
    match = m.match_prefix(TOKENS[:13])
    assert match.page_ids == {"full": [1, 2, 3], "swa_4": [0, 2, 3]}
    assert m.allocate_slots("d", 14, match, num_computed_tokens=13)
    # full: the 3 hit pages and 4 new; window: positions 5, 6 (keys 10..13) only, none of the hit
    assert m.page_ids("d") == {"full": [1, 2, 3, 4, 5, 6, 7], "swa_4": [0, 0, 0, 0, 0, 4, 5]}
    assert m.stats().groups["swa_4"].used == 5
    with pytest.raises(ValueError, match="below the prefix"):
        m.allocate_slots("e", 14, m.match_prefix(TOKENS[:13]), num_computed_tokens=2)
    assert not m.has_request("e")


def test_all_or_nothing_counts_released_pages(make_manager: MakeManager) -> None:
    m = hybrid(make_manager, ReusePolicy.NONE, num_pages=5)  # 4 usable pages per group
    assert m.allocate_slots("r", 8, num_computed_tokens=0)  # 4 pages each: both groups full
    assert not m.allocate_slots("r", 10)  # no release without computed tokens: no room
    assert m.page_ids("r")["swa_4"] == [1, 2, 3, 4]
    # Position 8's window reads 5..8: pages 0 and 1 are released, one is taken back.
    assert not m.allocate_slots("r", 10, num_computed_tokens=8)  # the full group has no room
    assert m.page_ids("r") == {"full": [1, 2, 3, 4], "swa_4": [1, 2, 3, 4]}  # nothing changed
    m.free("r")
    only_window = make_manager(
        ReusePolicy.NONE,
        groups=[group_spec("swa_4", (0,), num_pages=5, page_size=2, sliding_window=4)],
    )
    assert only_window.allocate_slots("r", 8, num_computed_tokens=0)
    assert only_window.allocate_slots("r", 10, num_computed_tokens=8)
    assert only_window.page_ids("r") == {"swa_4": [0, 0, 3, 4, 2]}


def test_next_release_and_fit_queries(make_manager: MakeManager) -> None:
    m = hybrid(make_manager, ReusePolicy.NONE)
    assert m.allocate_slots("r", 3, num_computed_tokens=0)
    assert m.next_release_at("r") == 5
    full_only = make_manager(ReusePolicy.NONE)
    assert full_only.allocate_slots("r", 3)
    assert full_only.next_release_at("r") == NO_RELEASE
    with pytest.raises(KeyError):
        m.next_release_at("nobody")
    assert m.max_pages_per_request(20, 4) == {"full": 10, "swa_4": 4}
    assert m.fits_alone(22, 4) and not m.fits_alone(23, 4)  # 12 pages: 11 usable
    assert m.max_pages_per_request(1000, 1)["swa_4"] == 3


def test_stats_carry_windows_and_interval_peaks(make_manager: MakeManager) -> None:
    m = hybrid(make_manager, ReusePolicy.ALL_REUSABLE)
    prefill(m, "a", TOKENS[:12], chunk=4)
    m.free("a")
    s = m.stats().groups
    assert (s["full"].sliding_window, s["swa_4"].sliding_window) == (None, 4)
    assert (s["swa_4"].peak_used, s["swa_4"].peak_evictable, s["swa_4"].free_low_water) == (4, 6, 5)
    m.reset_peak()
    s = m.stats().groups["swa_4"]
    assert (s.peak_used, s.peak_evictable, s.free_low_water) == (0, 6, 5)
    assert m.allocate_slots("b", 12, num_computed_tokens=0)  # 5 plain free, then 1 evicted
    s = m.stats().groups["swa_4"]
    assert (s.peak_used, s.peak_evictable, s.free_low_water, s.evictions) == (6, 6, 0, 1)


def test_the_peak_of_all_groups_together_is_not_the_sum_of_their_peaks(
    make_manager: MakeManager,
) -> None:
    """The window group peaks in the prefill (a 12-token chunk reads all 6 of its pages), the full
    group at the end of decode: the most pages held at once is the total's own peak, counted as
    pages are taken (/metrics' peak KV usage summed the groups' peaks: 16 pages, never held)."""
    m = hybrid(make_manager, ReusePolicy.NONE)
    assert m.allocate_slots("a", 12, num_computed_tokens=0)  # full 6 + window 6
    for n in range(13, 19):
        assert m.allocate_slots("a", n, num_computed_tokens=n - 1)
    # At 13 the full group took page 6 as the window gave back 4 of its pages: released first, so
    # never counted together (7 + 6); since then at most full 9 + window 3.
    assert m.stats().peak_used == 12
    for n in (19, 20):
        assert m.allocate_slots("a", n, num_computed_tokens=n - 1)
    s = m.stats()
    assert (s.groups["full"].peak_used, s.groups["swa_4"].peak_used) == (10, 6)  # each its own
    assert s.peak_used == 13  # full 10 + window 3, at 19
    # Usage is the fullest group's (each a pool of its own; 11 usable pages each): full 10 of
    # 11 now (the window 2), and its peak the fullest group's own.
    assert s.peak_usage == 10 / 11 and s.usage == 10 / 11  # (together: 12 of 22)
    assert not m.allocate_slots("b", 8, num_computed_tokens=0)  # (4 full pages: it is full)
    m.free("a")
    assert m.stats().peak_used == 13
    m.reset_peak()
    assert m.stats().peak_used == 0


def test_a_page_released_and_evicted_in_one_step_is_not_an_evictable_peak(
    make_manager: MakeManager,
) -> None:
    """A full window pool: each chunk releases one committed window page (evictable) and takes
    one, evicting the oldest in the same call. Between calls at most 2 pages are evictable; the
    interval peak said 3 (the page that was evictable only inside the call)."""
    m = make_manager(
        groups=[
            group_spec("full", (0,), num_pages=40, page_size=2),
            group_spec("swa_2", (1,), num_pages=5, page_size=2, sliding_window=2),
        ]
    )
    tokens = list(range(100, 140))
    assert m.allocate_slots("a", 8, m.match_prefix(tokens[:8] + [0]), num_computed_tokens=0)
    m.commit("a", tokens, 8, prompt_done=False)
    m.reset_peak()
    done, seen = 8, 0
    for _ in range(12):
        assert m.allocate_slots("a", done + 2, num_computed_tokens=done)
        done += 2
        m.commit("a", tokens, done, prompt_done=False)
        seen = max(seen, m.stats().groups["swa_2"].evictable)
    assert m.stats().groups["swa_2"].peak_evictable == seen == 2
    m.free("a")
