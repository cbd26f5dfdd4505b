"""Sliding-window page arithmetic, on small numbers worked out by hand."""

import pytest

from kvcache.sliding_window import (
    first_needed_page,
    longest_window_hit,
    max_pages_held,
    pages_before_hit,
    release_point,
)


@pytest.mark.parametrize(
    ("computed", "window", "page_size", "expected"),
    [(0, 4, 2, 0), (4, 4, 2, 0), (5, 4, 2, 1), (6, 4, 2, 1), (7, 4, 2, 2), (10, 1, 4, 2)],
)
def test_first_needed_page(computed: int, window: int, page_size: int, expected: int) -> None:
    # the query at `computed` reads computed - window + 1 ..: page p is needed iff it holds one of those
    assert first_needed_page(computed, window, page_size) == expected


def test_release_point_is_where_first_needed_page_moves_past() -> None:
    for first, window, ps in [(0, 4, 2), (3, 4, 2), (2, 5, 4), (0, 1, 1)]:
        at = release_point(first, window, ps)
        assert first_needed_page(at - 1, window, ps) <= first < first_needed_page(at, window, ps)


def test_pages_before_hit() -> None:
    assert pages_before_hit(4, 2) == 2  # keys t-3 .. t-1: 3 tokens, 2 pages when t is a boundary
    assert pages_before_hit(5, 2) == 2
    assert pages_before_hit(6, 2) == 3
    assert pages_before_hit(1, 4) == 0  # a window of one token reads only itself


@pytest.mark.parametrize(
    ("tokens", "window", "step", "expected"),
    [
        (100, None, 8, 25),  # full attention: the whole context (page_size 4)
        (100, 8, 1, 3),  # decode: 8 keys at any offset touch at most 3 pages
        (100, 8, 8, 5),  # 7 keys + 8 new tokens = 15 tokens -> ceil(14/4) + 1
        (6, 8, 8, 2),  # never more than the context has
        (0, 8, 8, 0),
    ],
)
def test_max_pages_held(tokens: int, window: int | None, step: int, expected: int) -> None:
    assert max_pages_held(tokens, 4, window, step) == expected


def test_max_pages_held_is_the_worst_case_over_offsets() -> None:
    ps, window, step = 4, 8, 8
    worst = 0
    for computed in range(0, 200):
        first = first_needed_page(computed, window, ps)
        last = (computed + step - 1) // ps
        worst = max(worst, last - first + 1)
    assert worst == max_pages_held(1000, ps, window, step)


@pytest.mark.parametrize(
    ("cached", "max_pages", "needed", "expected"),
    [
        ("11111", 5, 2, 5),
        ("11101", 5, 2, 3),  # page 3 missing: the window before 5 (pages 3, 4) is broken
        ("00011", 5, 2, 5),  # only the window before the hit must be cached
        ("00010", 5, 2, 0),  # page 3 alone is no window of 2 (and 4 ends no hit)
        ("10000", 5, 2, 1),  # a hit at 1 needs only page 0
        ("11111", 3, 2, 3),  # capped by max_pages
        ("00000", 5, 0, 5),  # nothing needed
    ],
)
def test_longest_window_hit(cached: str, max_pages: int, needed: int, expected: int) -> None:
    assert longest_window_hit(lambda i: cached[i] == "1", max_pages, needed) == expected
