"""InFlightPages: which uncached pages running prefills are computing (engine/inflight_pages.py)."""

from __future__ import annotations

from engine.inflight_pages import InFlightPages
from kvcache.block_hash import hash_full_pages
from kvcache.prefix_match import PrefixMatch

from .conftest_engine import make_request

SHARED = list(range(20, 28))  # two pages of 4


def test_pages_of_a_running_prefill_are_in_flight_for_others_only() -> None:
    pages = InFlightPages(page_size=4)
    leader = make_request("leader", SHARED + [1, 2, 3, 4, 5])  # three full pages, one partial
    pages.add(leader, PrefixMatch())
    assert len(pages) == 3 and "leader" in pages
    follower = make_request("follower", SHARED + [9])
    assert pages.first_uncached_page_in_flight(follower, PrefixMatch())
    assert not pages.first_uncached_page_in_flight(leader, PrefixMatch())  # its own pages
    stranger = make_request("stranger", [99] + SHARED)
    assert not pages.first_uncached_page_in_flight(stranger, PrefixMatch())
    pages.drop("leader")
    assert len(pages) == 0 and not pages.first_uncached_page_in_flight(follower, PrefixMatch())
    pages.drop("leader")  # idempotent


def test_pages_after_a_cached_prefix_chain_from_it() -> None:
    pages = InFlightPages(page_size=4)
    hashes = hash_full_pages(SHARED, 4)
    cached = PrefixMatch(
        num_tokens=4, page_ids={"full": [7]}, block_hashes=hashes[:1], num_query_tokens=9
    )
    leader = make_request("leader", SHARED + [1])
    pages.add(leader, cached)  # only the second page is computed: the first was cached
    assert len(pages) == 1
    follower = make_request("follower", SHARED + [2, 3])
    assert pages.first_uncached_page_in_flight(follower, cached)
    assert not pages.first_uncached_page_in_flight(
        follower, PrefixMatch()
    )  # first page: not in flight
    short = make_request("short", SHARED[:6])  # no full page after the cached one
    assert not pages.first_uncached_page_in_flight(short, cached)


def test_a_page_already_claimed_stays_with_its_first_owner() -> None:
    pages = InFlightPages(page_size=4)
    pages.add(make_request("a", SHARED), PrefixMatch())
    pages.add(make_request("b", SHARED + [1, 2, 3, 4]), PrefixMatch())  # shares two, adds one
    assert len(pages) == 3
    pages.drop("a")
    assert len(pages) == 1  # b's own third page
    pages.drop("b")
    assert len(pages) == 0


def test_a_page_ending_at_the_last_token_is_never_waited_for() -> None:
    """A prompt whose last token ends the in-flight page cannot hit that page (a hit leaves the
    last token to compute): waiting for it would hold the request back for nothing."""
    pages = InFlightPages(page_size=4)
    pages.add(make_request("leader", SHARED + [1, 2, 3, 4]), PrefixMatch())
    assert not pages.first_uncached_page_in_flight(make_request("exact", SHARED[:4]), PrefixMatch())
    assert pages.first_uncached_page_in_flight(make_request("longer", SHARED[:5]), PrefixMatch())
