"""The KV host tier through the manager, on tiny CPU configs with exact page ids: which evicted
pages are offloaded and in what order, a load-back (the bytes come back), a host drop, a skipped
store, the stats after each, the KV events, and a hybrid (window) group's host pages."""

from __future__ import annotations

import pytest
import torch

from kvcache.block_hash import hash_full_pages
from kvcache.kv_events import KVEvent
from kvcache.manager import KVCacheManager
from kvcache.stats import HostTierStats
from tests.kvcache.conftest import MakeManager, group_spec

A = [1, 1, 2, 2, 3, 3]  # three pages of 2 tokens
B = [7, 7, 8, 8]


def fill(m: KVCacheManager, rid: str, tokens: list[int]) -> None:
    """Compute ``tokens`` for ``rid`` as the model would: slot value = token + 1 in every layer."""
    for g, pages in m.page_ids(rid).items():
        buf = m.buffers[g]
        for i, t in enumerate(tokens):
            buf[pages[i // m.page_size], :, :, :, i % m.page_size] = t + 1


def run(m: KVCacheManager, rid: str, tokens: list[int], keep: bool = False) -> None:
    """Admit ``rid`` from its longest cached prefix, compute the rest, commit, and free it."""
    match = m.match_prefix(tokens)
    assert m.allocate_slots(rid, len(tokens), match)
    fill(m, rid, tokens)
    m.commit(rid, tokens, len(tokens), prompt_done=True)
    if not keep:
        m.free(rid)


def host(m: KVCacheManager, g: str = "full") -> HostTierStats:
    stats = m.stats().groups[g].host
    assert stats is not None
    return stats


def test_evicted_reusable_pages_go_to_host_in_eviction_order(make_manager: MakeManager) -> None:
    m = make_manager(num_pages=4, page_size=2, host_pages=2)
    m.enable_events()
    h = hash_full_pages(A, 2)
    run(m, "a", A)  # pages [1, 2, 3], all registered, freed tail first: evicted 3, 2, 1
    assert m.drain_events() == [KVEvent("stored", "device", "full", h)]
    assert m.allocate_slots("b", 4)  # takes pages 3 and 2: their blocks go to host pages 0, 1
    assert m.page_ids("b") == {"full": [3, 2]}
    tier = m.host_tier
    assert tier is not None
    assert [tier.lookup("full", x) for x in h] == [None, 1, 0]
    assert m.drain_events() == [
        KVEvent("removed", "device", "full", [h[2]]),
        KVEvent("stored", "host", "full", [h[2]]),
        KVEvent("removed", "device", "full", [h[1]]),
        KVEvent("stored", "host", "full", [h[1]]),
    ]
    assert host(m) == HostTierStats(
        total=2, used=2, free=0, pinned=0, offloaded=2, loaded_back=0, hit_tokens=0, drops=0,
        skipped_stores=0,
    )  # fmt: skip
    # The host pages hold the device pages' bytes as they were when evicted.
    assert torch.equal(tier.buffers["full"][0, 0, 0, 0, :, 0], torch.tensor([4.0, 4.0]))
    assert torch.equal(tier.buffers["full"][1, 0, 0, 0, :, 0], torch.tensor([3.0, 3.0]))
    assert m.stats().groups["full"].evictions == 2
    m.free("b")
    assert m.cached_blocks() == {"full": {"device": [h[0]], "host": [h[2], h[1]]}}


def test_a_prefix_hit_loads_host_pages_back_before_the_request_computes(
    make_manager: MakeManager,
) -> None:
    m = make_manager(num_pages=5, page_size=2, host_pages=2)
    h = hash_full_pages(A, 2)
    run(m, "a", A)  # [1, 2, 3]
    run(m, "b", B)  # pages 4 and 3 (evicting A's last page to host page 0)
    match = m.match_prefix(A + [9])
    assert (match.num_tokens, match.page_ids, match.host_pages) == (
        6,
        {"full": [1, 2, 0]},
        {"full": {2: 0}},
    )
    assert match.num_host_tokens == 2
    m.enable_events()
    assert m.allocate_slots("c", 7, match, num_computed_tokens=6)
    # Device pages 1, 2 touched; the host page loaded into B's last page 3 and the tail page is
    # B's first, 4 (both B's blocks evicted to host: the second drops the first, the host page
    # being loaded is pinned).
    pages = m.page_ids("c")["full"]
    assert pages == [1, 2, 3, 4] and not m.loads_pending("c")
    buf = m.buffers["full"]
    assert torch.equal(buf[3, 0, 0, 0, :, 0], torch.tensor([4.0, 4.0]))  # tokens 3, 3
    assert host(m) == HostTierStats(
        total=2, used=2, free=0, pinned=0, offloaded=3, loaded_back=1, hit_tokens=2, drops=1,
        skipped_stores=0,
    )  # fmt: skip
    events = m.drain_events()
    assert KVEvent("stored", "device", "full", [h[2]]) in events  # findable on the device again
    assert m.match_prefix(A + [9]).host_pages == {}  # the device copy is preferred now
    s = m.stats()
    assert (s.reuse_hit_tokens, s.reuse_host_hit_tokens) == (6, 2)
    m.free("c")


def test_a_page_dropped_from_host_before_any_reuse_is_a_host_drop(
    make_manager: MakeManager,
) -> None:
    m = make_manager(num_pages=4, page_size=2, host_pages=1)
    m.enable_events()
    h = hash_full_pages(A, 2)
    run(m, "a", A)  # [1, 2, 3]
    m.drain_events()
    assert m.allocate_slots("b", 4)  # evicts 3 (h2 -> host page 0) then 2 (h1 drops h2)
    assert m.drain_events() == [
        KVEvent("removed", "device", "full", [h[2]]),
        KVEvent("stored", "host", "full", [h[2]]),
        KVEvent("removed", "device", "full", [h[1]]),
        KVEvent("removed", "host", "full", [h[2]]),
        KVEvent("stored", "host", "full", [h[1]]),
    ]
    assert host(m) == HostTierStats(
        total=1, used=1, free=0, pinned=0, offloaded=2, loaded_back=0, hit_tokens=0, drops=1,
        skipped_stores=0,
    )  # fmt: skip
    assert m.stats().host_drops == 1
    m.free("b")


def test_a_host_page_reused_before_it_is_dropped_is_no_host_drop(
    make_manager: MakeManager,
) -> None:
    m = make_manager(num_pages=5, page_size=2, host_pages=1)
    h = hash_full_pages(A, 2)
    run(m, "a", A)  # [1, 2, 3], page 4 plain free
    run(m, "b", B)  # takes 4, then 3: A's last block to the host page
    run(m, "c", A + [9])  # loads it back (the host copy stays: the tier is inclusive)
    assert (host(m).loaded_back, host(m).drops, host(m).offloaded) == (1, 0, 1)
    tier = m.host_tier
    assert tier is not None and tier.lookup("full", h[2]) == 0
    # Three new pages: C's plain page 4, then its page 3 (A's last block: already on host, no
    # second copy), then 2 (A's second block: stored, dropping the reused block: no host drop).
    run(m, "d", [5, 5, 6, 6, 5, 5])
    assert (tier.lookup("full", h[2]), tier.lookup("full", h[1])) == (None, 0)
    assert (host(m).offloaded, host(m).drops) == (2, 0)


def test_an_eviction_finding_every_host_page_pinned_is_a_skipped_store(
    make_manager: MakeManager,
) -> None:
    m = make_manager(num_pages=5, page_size=2, host_pages=1)
    run(m, "a", A)  # [1, 2, 3]
    run(m, "b", B)  # [4, 3]: A's last block to host page 0
    match = m.match_prefix(A + [9])
    assert match.host_pages == {"full": {2: 0}}
    # The load-back takes device page 3 (B's last block) and the tail page 4 (B's first): both
    # evicted while the one host page is pinned by this very load-back, so neither is stored.
    assert m.allocate_slots("c", 7, match, num_computed_tokens=6)
    assert m.page_ids("c") == {"full": [1, 2, 3, 4]}
    assert host(m) == HostTierStats(
        total=1, used=1, free=0, pinned=0, offloaded=1, loaded_back=1, hit_tokens=2, drops=0,
        skipped_stores=2,
    )  # fmt: skip
    assert m.match_prefix(B + [0]).num_tokens == 0  # B's blocks are gone from both tiers
    m.free("c")


def test_a_stale_host_match_is_refused(make_manager: MakeManager) -> None:
    m = make_manager(num_pages=5, page_size=2, host_pages=1)
    run(m, "a", A)
    run(m, "b", B)  # A's last block to host
    match = m.match_prefix(A + [9])
    run(m, "keep", A[:4] + [0], keep=True)  # holds A's first two device pages
    run(m, "c", [5, 5])  # evicts B's last block into the host page: A's is dropped
    with pytest.raises(ValueError, match="stale PrefixMatch: host page 0 of group 'full'"):
        m.allocate_slots("d", 7, match, num_computed_tokens=6)
    m.free("keep")


def test_window_groups_offload_and_load_back_their_pages(make_manager: MakeManager) -> None:
    """Gemma-like: a full group and a window of 3 tokens (a hit at t reads pages of t-2 .. t-1)."""
    groups = [
        group_spec("full", (0,), num_pages=7, page_size=2),
        group_spec("swa_3", (1,), num_pages=6, page_size=2, sliding_window=3),
    ]
    m = make_manager(groups=groups, host_pages=2)
    prompt = [1, 1, 2, 2, 3, 3, 4, 4]
    run(m, "a", prompt)  # full [1..4]; window holds its last pages, released ones evictable
    run(m, "b", [7, 7, 8, 8, 9, 9])  # the window group evicts A's window pages to host
    assert host(m, "swa_3").offloaded >= 1
    match = m.match_prefix(prompt + [5])
    assert match.num_tokens == 8 and "swa_3" in match.host_pages
    assert m.allocate_slots("c", 9, match, num_computed_tokens=8)
    fill_check = m.page_ids("c")["swa_3"]
    buf = m.buffers["swa_3"]
    for i in match.host_pages["swa_3"]:  # loaded back: the tokens of those positions
        assert torch.equal(
            buf[fill_check[i], 0, 0, 0, :, 0], torch.tensor([prompt[2 * i] + 1.0] * 2)
        )
    assert host(m, "swa_3").loaded_back == len(match.host_pages["swa_3"])
    m.free("c")


def test_host_tier_needs_every_group() -> None:
    with pytest.raises(ValueError, match="host_tier_pages must name the groups"):
        KVCacheManager([group_spec()], "all_reusable", "cpu", host_tier_pages={"swa": 1})


def test_host_tokens_taken_are_those_loaded_back(make_manager: MakeManager) -> None:
    """The decode worker allocates a prompt as computed: a window group's host page before its
    window is not loaded back, and is not reported as host-tier tokens (the match's
    num_host_tokens counted it: /perf_metrics said tokens came from the host tier that did not)."""
    m = make_manager(
        groups=[
            group_spec("full", (0,), num_pages=20, page_size=2),
            group_spec("swa_2", (1,), num_pages=8, page_size=2, sliding_window=2),
        ],
        host_pages=8,
    )
    a = list(range(100, 112))  # 6 pages
    run(m, "a", a)
    run(m, "b", list(range(500, 514)))  # the small window pool offloads a's window pages
    prompt = a + [7] * 7
    match = m.match_prefix(prompt)
    assert match.num_tokens == 12 and match.num_host_tokens == 2
    assert m.allocate_slots("d", len(prompt) + 1, match, num_computed_tokens=len(prompt))
    assert match.host_tokens_taken(m.page_ids("d")) == 0  # (its window starts past the hit)
    assert host(m, "swa_2").loaded_back == 0
    m.free("d")
    # The engine's own admission computes from the hit: the host page is loaded back.
    match = m.match_prefix(prompt)
    assert m.allocate_slots("e", len(prompt), match)
    assert match.host_tokens_taken(m.page_ids("e")) == match.num_host_tokens == 2
    assert host(m, "swa_2").loaded_back == 1
    m.free("e")


@pytest.mark.parametrize("host_tier", [False, True])
def test_reset_prefix_cache_forgets_the_host_tier_only_when_asked(
    make_manager: MakeManager, host_tier: bool
) -> None:
    m = make_manager(num_pages=4, page_size=2, host_pages=3)
    h = hash_full_pages(A, 2)
    run(m, "a", A)
    assert m.allocate_slots("b", 6)  # evicts all of A's pages to the host tier
    assert m.match_prefix(A + [9]).page_ids == {"full": [0, 0, 0]}  # (all on the host)
    m.free("b")
    m.enable_events()
    assert m.reset_prefix_cache(host_tier=host_tier)
    on_host = [] if host_tier else [h[2], h[1], h[0]]
    assert m.cached_blocks() == {"full": {"device": [], "host": on_host}}
    assert m.drain_events() == (
        [KVEvent("removed", "host", "full", [h[2], h[1], h[0]])] if host_tier else []
    )
    assert m.match_prefix(A + [9]).num_tokens == (0 if host_tier else 6)
    assert (host(m).used, host(m).free) == (len(on_host), 3 - len(on_host))
