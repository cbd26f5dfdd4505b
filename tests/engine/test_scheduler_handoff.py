"""The disaggregation hooks: prefill-only requests (keep pages after the first token), requests
whose KV was filled from elsewhere (start RUNNING at the prompt length), and requests whose KV
never arrived (recomputed here from the prompt and the first token)."""

from __future__ import annotations

import time

import pytest

from engine.request import RequestStatus

from .conftest_engine import assert_no_leak, make_request, run_step, tiny_kv, tiny_scheduler


def test_prefill_only_request_keeps_committed_pages_until_release() -> None:
    kv = tiny_kv(page_size=4)
    sched = tiny_scheduler(kv, prefill_chunk_size=4)
    prompt = list(range(300, 310))
    req = make_request("p", prompt, prefill_only=True, max_tokens=5)
    sched.add_request(req)
    for _ in range(3):  # chunks of 4, 4, 2 tokens; the last one samples
        out, changed = run_step(sched)
    assert changed == [req] and req.status is RequestStatus.PREFILLED and not req.is_finished
    assert req.output_token_ids == [7] and req.finish_reason is None
    assert not sched.has_unfinished() and sched.running == []
    assert kv.page_ids("p") == req.page_ids and len(req.page_ids["full"]) == 3
    assert kv.match_prefix(prompt + [1]).num_tokens == 8  # finalized: full pages committed
    out, _ = run_step(sched)
    assert out.released_ids == ["p"] and out.requests == []
    sched.release("p")
    assert_no_leak(kv)
    with pytest.raises(ValueError, match="not a prefilled request"):
        sched.release("p")


def test_prefill_only_request_that_stops_at_its_first_token_frees_its_pages() -> None:
    kv = tiny_kv()
    sched = tiny_scheduler(kv)
    req = make_request("p", 6, prefill_only=True, max_tokens=1)
    sched.add_request(req)
    run_step(sched)
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert_no_leak(kv)


def test_prefilled_request_starts_with_a_decode_step() -> None:
    kv = tiny_kv(page_size=4)
    sched = tiny_scheduler(kv)
    prompt = list(range(400, 406))
    assert kv.allocate_slots("d", len(prompt))  # the decode worker's gen-init, KV written elsewhere
    req = make_request("d", prompt, max_tokens=3)
    sched.add_prefilled_request(req, first_token_id=42)
    assert req.status is RequestStatus.RUNNING and req.num_computed_tokens == 6
    assert req.output_token_ids == [42] and req.metrics.first_token_time is not None
    assert kv.match_prefix(prompt + [1]).num_tokens == 4  # context finalized before decoding
    out, _ = run_step(sched)
    assert out.requests == [req] and out.num_new_tokens == [1] and out.sample == [True]
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (0, 1)
    assert len(req.page_ids["full"]) == 2  # 7 tokens of context
    run_step(sched)
    assert req.output_token_ids == [42, 7, 7] and req.finish_reason == "length"
    # Gaps between the tokens sampled here only: 2 tokens, 1 gap (the one from P's first token
    # is the collector's to add: cluster.messages.PerfRecord.token_gaps_s).
    assert len(req.token_gaps) == 1
    assert_no_leak(kv)


def test_prefilled_requests_beyond_max_num_seqs_wait_for_a_place_with_their_pages() -> None:
    """decode.scheduler.max_num_seqs bounds a decode worker's batch too: prefilled requests past
    it wait aside with their pages (they all ran at once before), join first as places free, and
    an abort of a waiting one frees its pages."""
    kv = tiny_kv(page_size=4)
    sched = tiny_scheduler(kv, max_num_seqs=2)
    reqs = []
    for i, max_tokens in enumerate((2, 3, 2, 2, 2)):
        rid = f"d{i}"
        assert kv.allocate_slots(rid, 5)
        reqs.append(
            make_request(rid, list(range(500 + 10 * i, 505 + 10 * i)), max_tokens=max_tokens)
        )
        sched.add_prefilled_request(reqs[-1], first_token_id=42)
    added = time.time()
    assert sched.running == reqs[:2] and list(sched.ready) == reqs[2:]
    assert (sched.num_running, sched.num_waiting) == (2, 3)
    assert sched.abort("d4") is reqs[4] and not kv.has_request("d4")
    sched.add_request(make_request("new", 4, max_tokens=1))  # a waiting one joins after them
    batches = []
    while sched.has_unfinished():
        out, _ = run_step(sched)
        batches.append([r.request_id for r in out.requests])
        assert len(out.requests) <= 2
    assert batches == [["d0", "d1"], ["d1", "d2"], ["d3", "new"]]
    assert all(r.finish_reason == "length" for r in reqs[:4])
    # Those that waited for a place were scheduled when they joined (the wait is their queue
    # time), not when they were added.
    joined = [r.metrics.first_scheduled_time for r in reqs[:4]]
    assert joined[0] <= added and joined[1] <= added < joined[2] <= joined[3]
    assert_no_leak(kv)


def test_a_prefilled_request_waiting_for_a_place_is_preempted_before_a_running_one() -> None:
    """Out of pages, a running request preempts the prefilled ones waiting for a place first:
    idle, and newer than it."""
    kv = tiny_kv(num_pages=5, page_size=4, reuse_policy="none")  # 4 usable pages
    sched = tiny_scheduler(kv, max_num_seqs=1)
    reqs = []
    for rid in ("d0", "d1"):
        assert kv.allocate_slots(rid, 5)  # 2 pages each: now none is free
        reqs.append(make_request(rid, [1, 2, 3, 4], max_tokens=8))
        sched.add_prefilled_request(reqs[-1], first_token_id=42)
    d0, d1 = reqs
    assert sched.running == [d0] and list(sched.ready) == [d1]
    while d1.status is not RequestStatus.PREEMPTED:  # d0 needs a third page at position 8
        run_step(sched)
        assert d0.status is RequestStatus.RUNNING and d0.metrics.num_preemptions == 0
    assert not sched.ready and sched.waiting[0] is d1
    while sched.has_unfinished():
        run_step(sched)
    assert [r.finish_reason for r in reqs] == ["length", "length"]
    assert d1.output_token_ids[0] == 42 and len(d1.output_token_ids) == 8
    assert_no_leak(kv)


def test_prefilled_request_finishing_at_its_first_token_frees_its_pages() -> None:
    kv = tiny_kv()
    sched = tiny_scheduler(kv)
    assert kv.allocate_slots("d", 5)
    req = make_request("d", 5, eos=(2,))
    sched.add_prefilled_request(req, first_token_id=2)
    assert req.status is RequestStatus.FINISHED_STOPPED and not sched.has_unfinished()
    assert_no_leak(kv)


def test_prefilled_request_needs_its_pages() -> None:
    kv = tiny_kv(page_size=4)
    sched = tiny_scheduler(kv)
    with pytest.raises(ValueError, match="holds no pages"):
        sched.add_prefilled_request(make_request("d", 5), 1)
    assert kv.allocate_slots("d", 4)
    with pytest.raises(
        ValueError, match="holds pages for 4 tokens, fewer than its 5 prompt tokens need"
    ):
        sched.add_prefilled_request(make_request("d", 5), 1)
    kv.free("d")
    assert_no_leak(kv)


def test_recomputed_request_prefills_its_prompt_and_first_token_then_decodes() -> None:
    """A prefilled request whose KV never arrived (transfer.on_failure: recompute): it waits with
    the prefill worker's first token, its prefill computes prompt and that token, and it samples
    the next one."""
    kv = tiny_kv(page_size=4)
    sched = tiny_scheduler(kv)
    prompt = list(range(500, 506))
    req = make_request("r", prompt, max_tokens=3)
    sched.add_recomputed_request(req, first_token_id=42)
    assert req.status is RequestStatus.WAITING and req.output_token_ids == [42]
    out, _ = run_step(sched)
    assert out.requests == [req] and out.num_new_tokens == [7] and out.sample == [True]
    assert req.output_token_ids == [42, 7]
    run_step(sched)
    assert req.output_token_ids == [42, 7, 7] and req.finish_reason == "length"
    assert_no_leak(kv)


def test_recomputed_request_finishing_at_its_first_token_frees_everything() -> None:
    kv = tiny_kv()
    sched = tiny_scheduler(kv)
    req = make_request("r", 5, eos=(2,))
    sched.add_recomputed_request(req, first_token_id=2)
    assert req.status is RequestStatus.FINISHED_STOPPED and not sched.has_unfinished()
    assert_no_leak(kv)
