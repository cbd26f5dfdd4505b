"""One pool group's part of an allocation: the plan (window release, scratch reuse, fresh and
loaded-back pages, the room check) made before anything changes, then carried out on the
request's page list.

Planning every group before any changes is what makes ``KVCacheManager.allocate_slots`` all or
nothing. Window and scratch-reuse rules: kvcache/manager.py's docstring, kvcache/sliding_window.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.page_pool import PagePool
from kvcache.prefix_match import PrefixMatch
from kvcache.request_pages import RequestPages
from kvcache.sliding_window import first_needed_page
from kvcache.spec import NULL_PAGE


@dataclass
class GroupPlan:
    """What one ``allocate_slots`` call does in one group, decided before anything changes."""

    start: int  # first page index the group keeps (entries before it become the null page)
    release: list[int]  # held pages that leave the window, in token order
    recycle: list[int]  # of those, the ones rewritten in place as new pages (scratch reuse)
    num_fresh: int  # new pages taken from the pool
    num_load: int = 0  # new pages taken for the prefix's host-tier pages (loaded back)


def plan_group(
    g: str,
    pool: PagePool,
    window: int | None,
    page_size: int,
    swa_scratch_reuse: bool,
    state: RequestPages | None,
    taken: PrefixMatch | None,
    computed: int | None,
    needed: int,
) -> GroupPlan | None:
    """Group ``g``'s plan for a request that holds ``state`` (None: its first call, taking the
    prefix ``taken``) and needs ``needed`` pages, its next query at ``computed`` (None: no
    release); None when the pool lacks room for it (counting the pages it releases)."""
    hosted: dict[int, int] = {}
    if state is not None:
        pages, first = state.pages[g], state.first_live[g]
    else:
        pages = taken.page_ids.get(g, []) if taken is not None else []
        hosted = taken.host_pages.get(g, {}) if taken is not None else {}
        first = next((i for i, p in enumerate(pages) if p != NULL_PAGE or i in hosted), len(pages))
    start = first
    if window is not None and computed is not None:
        start = max(first, first_needed_page(computed, window, page_size))
    kept_from = min(start, len(pages))
    fresh = max(needed, len(pages)) - max(len(pages), start)
    num_load = 0
    if state is None:  # prefix pages before the window are simply not taken
        release: list[int] = []
        recycle: list[int] = []
        to_take = [p for p in pages[kept_from:] if p != NULL_PAGE]
        room = pool.num_free - sum(1 for p in to_take if pool.ref_count(p) == 0)
        num_load = sum(1 for i in hosted if i >= kept_from)
        room -= num_load
    else:
        release = pages[first:kept_from]
        recycle = []
        if swa_scratch_reuse and window is not None and not state.prompt_done:
            recycle = [p for p in release if pool.ref_count(p) == 1 and pool.page_hash(p) is None][
                :fresh
            ]
        room = pool.num_free + sum(1 for p in release if pool.ref_count(p) == 1)
        room -= len(recycle)  # a recycled page never reaches the free queue
    plan = GroupPlan(start, release, recycle, fresh - len(recycle), num_load)
    return plan if plan.num_fresh <= room else None


def release_pages(state: RequestPages, g: str, pool: PagePool, plan: GroupPlan) -> None:
    """Give back the pages that leave group ``g``'s window (the recycled ones stay held)."""
    pages = state.pages[g]
    if plan.release:
        recycled = set(plan.recycle)
        # Oldest first: of a window's released pages, the oldest are evicted first.
        pool.free((p for p in plan.release if p not in recycled), note_peak=False)
        first = state.first_live[g]
        pages[first : first + len(plan.release)] = [NULL_PAGE] * len(plan.release)
    if plan.start > len(pages):  # positions no step will read: never given a page
        pages.extend([NULL_PAGE] * (plan.start - len(pages)))
    state.first_live[g] = max(state.first_live[g], plan.start)


def extend_pages(state: RequestPages, g: str, pool: PagePool, plan: GroupPlan, needed: int) -> None:
    """Append the recycled and fresh pages, so that group ``g``'s list has ``needed`` entries."""
    pages = state.pages[g]
    if plan.recycle or plan.num_fresh:
        pages.extend(plan.recycle)
        pages.extend(pool.allocate(plan.num_fresh))
    if len(pages) < needed:
        raise RuntimeError(f"{g}: planned {len(pages)} pages for {needed}")
