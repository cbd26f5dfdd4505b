"""Preemption by recompute when pages run out, and requests that can never fit the pool."""

from __future__ import annotations

from engine.request import Request, RequestStatus

from .conftest_engine import assert_no_leak, make_request, run_step, tiny_kv, tiny_scheduler


def counting_token(request: Request) -> int:
    """The n-th output token of every request is 50 + n: continuity after a recompute shows."""
    return 50 + request.num_output_tokens


def test_newest_running_request_is_preempted_and_recomputed_with_its_outputs() -> None:
    kv = tiny_kv(num_pages=5, page_size=4, reuse_policy="none")  # 4 usable pages
    sched = tiny_scheduler(kv)
    a = make_request("a", 4, max_tokens=8)
    b = make_request("b", 4, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(5):  # both reach 9 tokens (8 computed) holding 2 pages each: the pool is full
        out, _ = run_step(sched, counting_token)
        assert out.requests == [a, b] and not out.preempted
    assert kv.num_free_pages("full") == 0 and b.output_token_ids == [50, 51, 52, 53, 54]

    out, _ = run_step(sched, counting_token)  # a needs a third page: b (admitted last) makes room
    assert out.preempted == [b] and out.requests == [a]
    assert b.status is RequestStatus.PREEMPTED and list(sched.waiting) == [b]
    assert b.num_computed_tokens == 0 and b.page_ids == {} and not kv.has_request("b")
    assert b.output_token_ids == [50, 51, 52, 53, 54]  # produced tokens are kept
    assert b.metrics.num_preemptions == 1 and sched.num_preemptions == 1
    assert out.released_ids == ["b"]
    kv.check_integrity()

    while a.status is RequestStatus.RUNNING:  # b cannot come back while a holds 3 of 4 pages
        out, _ = run_step(sched, counting_token)
        assert out.requests == [a]
    assert a.finish_reason == "length" and a.output_token_ids == list(range(50, 58))

    out, _ = run_step(sched, counting_token)  # prompt + 5 outputs recomputed, then the 6th sampled
    assert out.requests == [b] and out.num_new_tokens == [9] and out.sample == [True]
    assert b.output_token_ids == [50, 51, 52, 53, 54, 55]
    while sched.has_unfinished():
        run_step(sched, counting_token)
    assert b.output_token_ids == list(range(50, 58)) and b.finish_reason == "length"
    assert_no_leak(kv)


def test_preemption_never_crashes_when_the_only_runner_is_starved() -> None:
    """Pages held outside the running set (a prefilled request awaiting transfer) starve the only
    running request: it preempts itself and waits until the pages come back."""
    kv = tiny_kv(num_pages=5, page_size=4, reuse_policy="none")
    sched = tiny_scheduler(kv)
    held = make_request("held", 12, prefill_only=True)  # 3 pages kept after its first token
    sched.add_request(held)
    run_step(sched)
    assert held.status is RequestStatus.PREFILLED and kv.num_free_pages("full") == 1
    runner = make_request("runner", 4, max_tokens=3)
    sched.add_request(runner)
    run_step(sched)  # 4 prompt tokens in the last free page, first token sampled
    out, _ = run_step(sched)  # 5 tokens need a second page: none free
    assert out.preempted == [runner] and out.requests == []
    for _ in range(3):
        out, _ = run_step(sched)
        assert out.requests == [] and sched.has_unfinished()
    sched.release("held")
    while sched.has_unfinished():
        run_step(sched)
    assert runner.finish_reason == "length" and runner.output_token_ids == [7, 7, 7]
    assert_no_leak(kv)


def test_prompt_larger_than_the_pool_finishes_with_an_error() -> None:
    kv = tiny_kv(num_pages=3, page_size=4)  # 2 usable pages = 8 tokens
    sched = tiny_scheduler(kv)
    big, small = make_request("big", 9), make_request("small", 3, max_tokens=1)
    sched.add_request(big)
    sched.add_request(small)
    out, _ = run_step(sched)
    assert out.finished == [big] and out.requests == [small]
    assert big.status is RequestStatus.FINISHED_ERROR and big.finish_reason == "abort"
    assert (
        big.error == "request 'big' needs 3 pages for 9 tokens, but the KV cache has only 2 pages"
    )
    assert not sched.has_unfinished()
    assert_no_leak(kv)


def test_request_outgrowing_the_pool_finishes_with_an_error_keeping_its_tokens() -> None:
    kv = tiny_kv(num_pages=3, page_size=4)
    sched = tiny_scheduler(kv)
    req = make_request("r", 7, max_tokens=10)
    sched.add_request(req)
    run_step(sched)  # 7 prompt tokens -> first token (8 tokens)
    run_step(sched)  # 8 computed -> second token (9 tokens)
    out, _ = run_step(sched)  # 9 tokens of context need a third page
    assert out.finished == [req] and out.preempted == []
    assert req.status is RequestStatus.FINISHED_ERROR and req.output_token_ids == [7, 7]
    assert "needs 3 pages for 9 tokens" in (req.error or "")
    assert_no_leak(kv)


def test_a_preempted_request_is_one_prefix_reuse_query() -> None:
    """Its admission after the preemption looks its prefix up again (its own pages may still be
    cached), but the reuse counters count each request once, as vLLM's hit rate leaves out
    preempted requests' queries: the hit rate is not inflated by a request finding itself."""
    kv = tiny_kv(num_pages=5, page_size=4)  # prefix reuse on
    sched = tiny_scheduler(kv)
    a = make_request("a", 4, max_tokens=8)
    b = make_request("b", 4, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    while not b.metrics.num_preemptions:
        run_step(sched, counting_token)
    while sched.has_unfinished():
        run_step(sched, counting_token)
    assert b.output_token_ids == list(range(50, 58))
    stats = kv.stats()
    assert stats.reuse_queries == 2
    assert stats.reuse_hit_tokens + stats.reuse_miss_tokens == 8  # the two 4-token prompts
    assert_no_leak(kv)
