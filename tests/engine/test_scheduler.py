"""Scheduler over a real KV cache manager, driven without a model: budgets, chunking, FIFO admission,
prefix reuse, stop conditions and aborts, with exact per-step decisions."""

from __future__ import annotations

import pytest
import torch

from engine.request import RequestStatus
from kvcache.manager import KVCacheManager
from kvcache.spec import PoolGroupSpec

from .conftest_engine import assert_no_leak, make_request, run_step, tiny_kv, tiny_scheduler


def test_token_budget_and_prefill_chunks_per_step() -> None:
    kv = tiny_kv(num_pages=33, page_size=4, reuse_policy="none")
    sched = tiny_scheduler(kv, max_num_batched_tokens=8, prefill_chunk_size=6)
    a, b = make_request("a", 10), make_request("b", 3)
    sched.add_request(a)
    sched.add_request(b)

    out, changed = run_step(sched)
    assert out.requests == [a, b] and out.num_new_tokens == [6, 2] and out.sample == [False, False]
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (8, 0) and changed == []
    assert (a.num_computed_tokens, b.num_computed_tokens) == (6, 2)
    assert a.page_ids == kv.page_ids("a") and len(a.page_ids["full"]) == 2

    out, changed = run_step(sched)  # the rest of both prompts; both sample their first token
    assert out.num_new_tokens == [4, 1] and out.sample == [True, True] and changed == [a, b]
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (5, 0)
    assert a.output_token_ids == [7] and b.output_token_ids == [7]

    out, _ = run_step(sched)
    assert out.num_new_tokens == [1, 1] and (out.num_prefill_tokens, out.num_decode_tokens) == (
        0,
        2,
    )
    assert len(a.page_ids["full"]) == 3  # 11 tokens of context
    for rid in ("a", "b"):
        sched.abort(rid)
    assert_no_leak(kv)


def test_running_requests_go_first_and_max_num_seqs_caps_admission() -> None:
    kv = tiny_kv(reuse_policy="none")
    sched = tiny_scheduler(kv, max_num_seqs=2)
    a, b, c = (
        make_request("a", 4, max_tokens=1),
        make_request("b", 4, max_tokens=3),
        make_request("c", 4),
    )
    for r in (a, b, c):
        sched.add_request(r)
    out, _ = run_step(sched)
    assert out.requests == [a, b] and list(sched.waiting) == [c]
    assert a.status is RequestStatus.FINISHED_LENGTH and a.finish_reason == "length"
    out, _ = run_step(sched)
    assert out.requests == [b, c] and out.num_new_tokens == [1, 4]
    assert out.released_ids == ["a"]
    while sched.has_unfinished():
        run_step(sched)
    assert c.status is RequestStatus.FINISHED_LENGTH and len(c.output_token_ids) == 16
    assert_no_leak(kv)


def test_admission_starts_from_the_cached_prefix() -> None:
    kv = tiny_kv(page_size=4)
    sched = tiny_scheduler(kv)
    prompt = list(range(100, 109))  # 9 tokens: two full pages get committed
    first = make_request("first", prompt, max_tokens=1)
    sched.add_request(first)
    run_step(sched)
    assert first.is_finished and first.metrics.num_cached_tokens == 0

    second = make_request("second", prompt[:8] + [500, 501])
    sched.add_request(second)
    out, _ = run_step(sched)
    assert out.requests == [second] and out.num_new_tokens == [2]
    assert second.metrics.num_cached_tokens == 8 and second.num_computed_tokens == 10
    stats = kv.stats()
    assert (stats.reuse_queries, stats.reuse_hit_tokens) == (2, 8)
    sched.abort("second")
    assert_no_leak(kv)


@pytest.mark.parametrize("policy", ["all_reusable", "none"])
def test_shared_prefix_in_one_batch_is_computed_once(policy: str) -> None:
    kv = tiny_kv(page_size=4, reuse_policy=policy)
    sched = tiny_scheduler(kv)
    shared = list(range(200, 208))
    a = make_request("a", shared + [1], max_tokens=2)
    b = make_request("b", shared + [2, 3, 4], max_tokens=1)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = run_step(sched)
    if policy == "none":  # nothing to reuse: no reason to wait
        assert out.requests == [a, b]
        return
    assert out.requests == [a] and list(sched.waiting) == [b]  # b waits one step for a's pages
    out, _ = run_step(sched)
    assert out.requests == [a, b] and out.num_new_tokens == [1, 3]
    assert b.metrics.num_cached_tokens == 8
    assert b.page_ids["full"][:2] == a.page_ids["full"][:2]  # the same physical pages
    while sched.has_unfinished():
        run_step(sched)
    assert_no_leak(kv)


def test_request_sharing_a_chunked_prefill_waits_for_its_pages_without_blocking_others() -> None:
    kv = tiny_kv(page_size=4)
    sched = tiny_scheduler(kv, prefill_chunk_size=4)
    shared = list(range(600, 612))  # three pages, computed by "a" over three chunks
    a = make_request("a", shared + [1], max_tokens=1)
    b = make_request("b", shared + [2, 3])
    c = make_request("c", list(range(700, 705)), max_tokens=3)
    for r in (a, b, c):
        sched.add_request(r)
    steps = []
    while b.status is RequestStatus.WAITING:
        out, _ = run_step(sched)
        steps.append([r.request_id for r in out.requests])
        assert list(sched.waiting) == ([b] if b.status is RequestStatus.WAITING else [])
    # "b" keeps its place while "a" computes the shared pages; "c" behind it is not held up
    assert steps == [["a", "c"], ["a", "c"], ["a", "c"], ["a", "c", "b"]]
    assert b.metrics.num_cached_tokens == 12 and b.page_ids["full"][:3] == a.page_ids["full"][:3]
    assert len(sched.inflight) == 0
    sched.abort("b")
    assert_no_leak(kv)


@pytest.mark.parametrize(
    ("kwargs", "status", "stop_reason", "num_out"),
    [
        ({"eos": (7,)}, RequestStatus.FINISHED_STOPPED, None, 1),
        (
            {"eos": (7,), "ignore_eos": True, "max_tokens": 3},
            RequestStatus.FINISHED_LENGTH,
            None,
            3,
        ),
        ({"stop_token_ids": [7]}, RequestStatus.FINISHED_STOPPED, 7, 1),
        ({"max_tokens": 4}, RequestStatus.FINISHED_LENGTH, None, 4),
    ],
)
def test_stop_conditions(
    kwargs: dict, status: RequestStatus, stop_reason: int | None, num_out: int
) -> None:
    kv = tiny_kv()
    sched = tiny_scheduler(kv)
    req = make_request("r", 5, **kwargs)
    sched.add_request(req)
    while sched.has_unfinished():
        run_step(sched)
    assert req.status is status and req.stop_reason == stop_reason
    assert req.output_token_ids == [7] * num_out  # the stopping token stays in the output
    assert req.metrics.finished_time is not None and req.metrics.num_output_tokens == num_out
    assert_no_leak(kv)


def test_max_model_len_ends_with_length() -> None:
    kv = tiny_kv()
    sched = tiny_scheduler(kv, max_model_len=8)
    req = make_request("r", 6, max_tokens=100)
    sched.add_request(req)
    while sched.has_unfinished():
        run_step(sched)
    assert req.finish_reason == "length" and req.num_tokens == 8 and len(req.output_token_ids) == 2
    with pytest.raises(ValueError, match="has 9 tokens, more than max_model_len=8"):
        sched.add_request(make_request("long", 9))
    assert_no_leak(kv)


def test_abort_frees_pages_of_waiting_running_and_in_flight_requests() -> None:
    kv = tiny_kv(reuse_policy="none")
    sched = tiny_scheduler(kv, max_num_seqs=2)
    a, b, c = make_request("a", 5), make_request("b", 5), make_request("c", 5)
    for r in (a, b, c):
        sched.add_request(r)
    out = sched.schedule()
    assert out.requests == [a, b]
    assert sched.abort("b") is b  # between schedule and update: its token is dropped
    changed = sched.update(out, [7, 7])
    assert changed == [a] and b.output_token_ids == [] and b.finish_reason == "abort"
    assert sched.abort("c") is c and c.status is RequestStatus.FINISHED_ABORTED
    assert sched.abort("c") is None and sched.abort("nope") is None
    assert sched.abort("a") is a and not sched.has_unfinished()
    assert_no_leak(kv)


def test_duplicate_and_reused_requests_are_rejected() -> None:
    sched = tiny_scheduler(tiny_kv())
    req = make_request("x", 3)
    sched.add_request(req)
    with pytest.raises(ValueError, match="request id 'x' is already in use"):
        sched.add_request(make_request("x", 3))
    sched.abort("x")
    with pytest.raises(ValueError, match="is not new"):
        sched.add_request(req)


def test_window_pages_are_released_as_decode_runs() -> None:
    """A full group and a window of 4 tokens, pages of 2: decode steps that need no new page still
    reach the manager when a page leaves the window, and the request's page lists follow."""
    groups = [
        PoolGroupSpec("full", (0,), 12, 2, 1, 2, torch.float32),
        PoolGroupSpec("swa_4", (1,), 12, 2, 1, 2, torch.float32, sliding_window=4),
    ]
    kv = KVCacheManager(groups, "none")
    sched = tiny_scheduler(kv, max_model_len=32)
    a = make_request("a", 6, max_tokens=5)
    sched.add_request(a)
    run_step(sched)  # prefill 6 tokens: pages 1, 2, 3 in both groups
    assert a.page_ids == {"full": [1, 2, 3], "swa_4": [1, 2, 3]} and a.kv_release_at == 5
    run_step(sched)  # decode at 6 reads 3..6: page 0 released (and taken back for position 3)
    assert a.page_ids == {"full": [1, 2, 3, 4], "swa_4": [0, 2, 3, 1]}
    assert (a.kv_capacity, a.kv_release_at) == (8, 7)
    run_step(sched)  # decode at 7 needs no new page, but page 1 leaves the window
    assert a.page_ids["swa_4"] == [0, 0, 3, 1]
    while sched.has_unfinished():
        run_step(sched)
    assert a.is_finished
    assert_no_leak(kv)


def test_a_request_finished_in_an_update_that_raises_leaves_running() -> None:
    """An update that fails after one request of the batch finished (here: one token too many
    for the batch) must not leave the finished request in ``running``: the next step would run
    it over the pages it has already given back."""
    kv = tiny_kv(num_pages=33, page_size=4)
    sched = tiny_scheduler(kv)
    a = make_request("a", 6, max_tokens=1)
    b = make_request("b", list(range(40, 46)), max_tokens=3)  # (not a: no shared prefix)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert out.sample == [True, True]
    with pytest.raises(ValueError, match="update got 3 sampled tokens for 2"):
        sched.update(out, [7, 7, 7])
    assert a.status is RequestStatus.FINISHED_LENGTH and sched.running == [b]
    for _ in range(10):  # b finishes alone; every page comes back
        if not sched.has_unfinished():
            break
        run_step(sched)
    assert b.num_output_tokens == 3
    assert_no_leak(kv)
