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


def test_a_preempted_request_is_admitted_before_new_receives_take_its_pages() -> None:
    """Transfers arrive faster than the worker serves them (two a step, 16 pages). A request
    preempted for pages gets them back within a few steps: receives wait while a request waits
    in the engine. Before, each receive (between two steps) took the pages a finished request
    freed, and the preempted one waited 400 steps and more (in serving: until its deadline)."""
    from engine.request import Request, RequestStatus
    from engine.sampling_params import SamplingParams
    from engine.scheduler import Scheduler
    from engine.scheduler_config import SchedulerConfig

    kv = KVCacheManager([group_spec("full", (0,), num_pages=17, page_size=4)], "none", "cpu")
    limits = dict(max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=64)
    scheduler = Scheduler(SchedulerConfig(page_size=4, max_model_len=64, **limits), kv)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6)
    arrived: list[Request] = []
    preempted: Request | None = None
    for step in range(400):
        for _ in range(2):
            arrived.append(Request(f"d{step}.{len(arrived)}", list(range(10, 17)), greedy))
        while arrived:  # the worker's receives between two steps, in arrival order
            r = arrived[0]
            if plan_receive(kv, r.request_id, r.prompt_token_ids, len(scheduler.waiting)) is None:
                break
            scheduler.add_prefilled_request(arrived.pop(0), 7)
        out = scheduler.schedule()
        scheduler.update(out, [7 for r, sampled in zip(out.requests, out.sample) if sampled])
        if out.preempted and preempted is None:
            preempted, since = out.preempted[0], step
        if preempted is not None and preempted.status is not RequestStatus.PREEMPTED:
            break
    assert preempted is not None, "the load preempted nobody: the test proves nothing"
    assert preempted.status is not RequestStatus.PREEMPTED and step - since <= 10
    kv.check_integrity()
