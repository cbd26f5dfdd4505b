"""Sliding-window page arithmetic: which pages a window group must hold, and where a prefix hit may end.

A window of W tokens means the query at position p reads keys p - W + 1 .. p. So before a step whose
first new token sits at position c (= the request's computed tokens), the group needs the keys from
c - W + 1 on: pages wholly before that can go. Pure functions of ints, shared by the manager, the
prefix lookup, sizing and the scheduler's never-fits check.
"""

from __future__ import annotations

from collections.abc import Callable


def first_needed_page(num_computed_tokens: int, window: int, page_size: int) -> int:
    """Index of the first page a request still needs when its next query sits at
    ``num_computed_tokens`` (every page before it holds only keys outside the window)."""
    return max(0, num_computed_tokens - window + 1) // page_size


def release_point(first_held_page: int, window: int, page_size: int) -> int:
    """The computed-token count from which page ``first_held_page`` leaves the window."""
    return (first_held_page + 1) * page_size + window - 1


def pages_before_hit(window: int, page_size: int) -> int:
    """Pages of keys a prefix hit ending on a page boundary t needs: those holding t - W + 1 .. t - 1."""
    return -(-(window - 1) // page_size)


def max_pages_held(
    num_tokens: int, page_size: int, window: int | None, max_step_tokens: int
) -> int:
    """Most pages one request of ``num_tokens`` tokens ever holds in a group at once, when a step
    computes at most ``max_step_tokens`` new tokens.

    Full attention: every page of the context. A window W: the W - 1 keys before the step plus the
    step's tokens, a span of W - 1 + q tokens at any offset, which touches at most
    ceil((W + q - 2) / page_size) + 1 pages (and never more than the context has).
    """
    context_pages = -(-num_tokens // page_size)
    if window is None or num_tokens == 0:
        return context_pages
    step = max(1, min(max_step_tokens, num_tokens))
    return min(context_pages, -(-(window + step - 2) // page_size) + 1)


def longest_window_hit(is_cached: Callable[[int], bool], max_pages: int, needed: int) -> int:
    """The largest k <= ``max_pages`` such that pages max(0, k - needed) .. k - 1 are all cached
    (``is_cached(i)`` says whether page i is): scanned right to left, as vLLM's hybrid allocator
    does for sliding-window groups. 0 (no hit) always qualifies."""
    if needed <= 0:
        return max_pages
    run, run_end = 0, max_pages
    for i in range(max_pages - 1, -1, -1):
        if not is_cached(i):
            run, run_end = 0, i
            continue
        run += 1
        if run >= needed or i == 0:
            return run_end
    return 0


def hybrid_hit_pages(
    max_pages: int, needed: dict[str, int], is_cached: Callable[[str, int], bool]
) -> int:
    """The longest hit of at most ``max_pages`` pages (what the full-attention groups hold) that
    every window group can serve too: group g must hold the ``needed[g]`` pages before the hit
    (``is_cached(g, i)``: whether g holds page i). Each window group shortens it in turn until all
    agree, since a window hit at k says nothing about shorter ones."""
    k = max_pages
    while True:
        before = k
        for g, need in needed.items():
            k = longest_window_hit(lambda i, g=g: is_cached(g, i), k, need)
        if k == before:
            return k
