"""The router's choice of workers (pure over its WorkerSlots: no actor is called to choose)."""

from __future__ import annotations

import time

from cluster.router import Router, WorkerSlot
from engine.sampling_params import SamplingParams
from worker_common.messages import GenerateRequest


def slots(prefix: str, n: int) -> list[WorkerSlot]:
    return [WorkerSlot(f"{prefix}-{i}", handle=None) for i in range(n)]


def req(tokens: list[int]) -> GenerateRequest:
    return GenerateRequest("r", tokens, SamplingParams(), time.time())


def test_load_balance_picks_the_least_outstanding_healthy_prefill() -> None:
    p = slots("p", 3)
    p[0].outstanding, p[1].outstanding, p[2].outstanding = 2, 1, 0
    p[2].healthy = False
    router = Router(p, slots("d", 1))
    assert router._pick_prefill(req([1, 2]), set()).worker_id == "p-1"
    assert router._pick_prefill(req([1, 2]), {"p-1"}).worker_id == "p-0"  # retry goes elsewhere
    assert router._pick_prefill(req([1, 2]), {"p-0", "p-1"}) is None  # nobody left: local fallback


def test_round_robin_takes_turns() -> None:
    router = Router(slots("p", 2), slots("d", 1), policy="round_robin")
    picks = [router._pick_prefill(req([1]), set()).worker_id for _ in range(4)]
    assert picks == ["p-1", "p-0", "p-1", "p-0"]


def test_prefix_aware_sends_a_shared_first_page_to_one_worker_unless_it_is_busy() -> None:
    p = slots("p", 4)
    router = Router(p, slots("d", 1), policy="prefix_aware", page_size=4)
    shared = [7, 7, 7, 7]
    first = router._pick_prefill(req(shared + [1, 2]), set())
    assert all(router._pick_prefill(req(shared + [k]), set()) is first for k in range(10))
    first.outstanding = 3  # clearly busier than the idle ones: load wins
    assert router._pick_prefill(req(shared + [1]), set()) is not first


def test_decode_choice_prefers_fewer_requests_then_more_free_pages() -> None:
    d = slots("d", 3)
    d[0].outstanding, d[1].outstanding, d[2].outstanding = 1, 0, 0
    d[1].free_pages, d[2].free_pages = 10, 50
    router = Router([], d)
    assert router._pick_decode().worker_id == "d-2"
    d[2].healthy = False
    assert router._pick_decode().worker_id == "d-1"
