"""plan_receive on a tiny hybrid KV manager: what D allocates for a prefilled request and which
pages the pull fills, per pool group (D's own prefix hits: test_decode_kv_groups.py)."""

from __future__ import annotations

import pytest

from decode_worker.receive_plan import ReceivePlan, plan_receive
from kvcache.manager import KVCacheManager
from kvcache.reuse_policy import ReusePolicy
from kvcache.spec import NULL_PAGE
from tests.kvcache.conftest import group_spec


def hybrid() -> KVCacheManager:
    """A full group and a window group of 4 tokens, 12 pages of 2 tokens each."""
    specs = [
        group_spec("full", (0,), num_pages=12, page_size=2),
        group_spec("swa_4", (1,), num_pages=12, page_size=2, sliding_window=4),
    ]
    return KVCacheManager(specs, ReusePolicy.ALL_REUSABLE, "cpu", False, None)


def test_the_pull_fills_the_prompt_pages_and_a_window_group_only_its_last_window() -> None:
    """9 prompt tokens: 5 prompt pages (the 10th token, the next one, shares the last); the
    window group holds only the pages of the tokens its window still reads (6 .. 9)."""
    kv = hybrid()
    plan = plan_receive(kv, "a", list(range(100, 109)))
    assert plan == ReceivePlan(
        hit_pages=0,
        host_hit_tokens=0,
        skip_pages={"full": 0, "swa_4": 3},
        dst_page_ids={"full": [1, 2, 3, 4, 5], "swa_4": [1, 2]},
    )
    assert kv.page_ids("a") == {"full": [1, 2, 3, 4, 5], "swa_4": [NULL_PAGE] * 3 + [1, 2]}
    kv.check_integrity()


def test_no_plan_takes_nothing_when_the_pages_are_not_free() -> None:
    kv = hybrid()
    assert plan_receive(kv, "a", list(range(100, 130))) is None  # (16 pages of 11)
    assert not kv.has_request("a")
    assert [kv.num_free_pages(g) for g in ("full", "swa_4")] == [11, 11]  # (page 0: the null page)
    kv.check_integrity()


def test_a_request_that_holds_pages_here_already_is_refused() -> None:
    """A second call for a request whose first still receives (a router retry after a lost
    answer): refused, the first's pages untouched."""
    kv = hybrid()
    first = plan_receive(kv, "a", list(range(100, 109)))
    assert first is not None
    held = kv.page_ids("a")
    with pytest.raises(ValueError, match="'a' already holds pages on this decode worker"):
        plan_receive(kv, "a", list(range(100, 109)))
    assert kv.page_ids("a") == held
    kv.free("a")
    kv.check_integrity()
