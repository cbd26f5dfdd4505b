"""The router's choice of workers (pure over its WorkerSlots: no actor is called to choose)."""

from __future__ import annotations

import time

import pytest

from cluster.kv_index import KVIndex
from cluster.router import Router
from cluster.worker_choice import WorkerSlot
from engine.sampling_params import SamplingParams
from kvcache.kv_events import KVEvent
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
    assert router.choice.pick_prefill(req([1, 2]), set()).worker_id == "p-1"
    assert (
        router.choice.pick_prefill(req([1, 2]), {"p-1"}).worker_id == "p-0"
    )  # retry goes elsewhere
    assert (
        router.choice.pick_prefill(req([1, 2]), {"p-0", "p-1"}) is None
    )  # nobody left: local fallback


def test_round_robin_takes_turns() -> None:
    router = Router(slots("p", 2), slots("d", 1), policy="round_robin")
    picks = [router.choice.pick_prefill(req([1]), set()).worker_id for _ in range(4)]
    assert picks == ["p-1", "p-0", "p-1", "p-0"]


def test_prefix_aware_sends_a_shared_first_page_to_one_worker_unless_it_is_busy() -> None:
    p = slots("p", 4)
    router = Router(p, slots("d", 1), policy="prefix_aware", page_size=4)
    shared = [7, 7, 7, 7]
    first = router.choice.pick_prefill(req(shared + [1, 2]), set())
    assert all(router.choice.pick_prefill(req(shared + [k]), set()) is first for k in range(10))
    first.outstanding = 3  # clearly busier than the idle ones: load wins
    assert router.choice.pick_prefill(req(shared + [1]), set()) is not first


def test_in_aggregated_mode_the_policy_picks_the_decode_worker() -> None:
    """router.policy picks the worker that prefills: a decode worker when there is no prefill
    worker (it was load balance whatever the policy said)."""
    router = Router([], slots("d", 3), policy="round_robin")
    picks = [router.choice.pick_aggregated(req([1]), None).worker_id for _ in range(3)]
    assert sorted(picks) == ["d-0", "d-1", "d-2"]
    d = slots("d", 4)
    router = Router([], d, policy="prefix_aware", page_size=4)
    first = router.choice.pick_aggregated(req([7, 7, 7, 7, 1]), None)
    assert all(router.choice.pick_aggregated(req([7, 7, 7, 7, k]), None) is first for k in range(9))


def test_decode_choice_prefers_fewer_requests_then_more_free_pages() -> None:
    d = slots("d", 3)
    d[0].outstanding, d[1].outstanding, d[2].outstanding = 1, 0, 0
    d[1].free_pages, d[2].free_pages = 10, 50
    router = Router([], d)
    assert router.choice.pick_decode().worker_id == "d-2"
    d[2].healthy = False
    assert router.choice.pick_decode().worker_id == "d-1"


def indexed_router(policy: str = "kv_aware", threshold: int = 0, n_decode: int = 1) -> Router:
    p, d = slots("p", 2), slots("d", n_decode)
    index = KVIndex([w.worker_id for w in p + d])
    return Router(
        p,
        d,
        policy=policy,
        page_size=4,
        kv_index=index,
        local_prefill_max_tokens=threshold,
    )


PROMPT = list(range(1, 22))  # 21 tokens: 5 full pages a hit can reach (one token is computed)


def hashes_of(router: Router, tokens: list[int], pages: int) -> list[int]:
    full = router.choice.block_hashes(req(tokens))
    assert full is not None
    return full[:pages]


def test_kv_aware_sends_a_request_where_its_prefix_is_cached() -> None:
    router = indexed_router()
    index = router.choice.kv_index
    assert index is not None
    assert router.choice.pick_prefill(
        req(PROMPT), set(), router.choice.block_hashes(req(PROMPT))
    ).worker_id
    index.apply("p-1", [KVEvent("stored", "device", "full", hashes_of(router, PROMPT, 3))])
    hashes = router.choice.block_hashes(req(PROMPT))
    assert router.choice.pick_prefill(req(PROMPT), set(), hashes).worker_id == "p-1"
    # p-0 holds more, but on its host tier: 5 pages at half weight (10) vs p-1's 12 tokens to go
    index.apply("p-0", [KVEvent("stored", "host", "full", hashes_of(router, PROMPT, 5))])
    assert router.choice.prefill_cost(router.prefill[0], 21, hashes) == 1 + 0.5 * 20
    assert router.choice.prefill_cost(router.prefill[1], 21, hashes) == 21 - 12
    assert router.choice.pick_prefill(req(PROMPT), set(), hashes).worker_id == "p-1"
    # ... unless p-1 already has prefill work queued from this router
    router.prefill[1].queued_prefill_tokens = 5
    assert router.choice.pick_prefill(req(PROMPT), set(), hashes).worker_id == "p-0"
    assert router.choice.pick_prefill(req(PROMPT), {"p-0"}, hashes).worker_id == "p-1"  # a retry


def test_kv_aware_without_any_cache_is_load_balance() -> None:
    router = indexed_router()
    router.prefill[0].outstanding = 2
    hashes = router.choice.block_hashes(req(PROMPT))
    assert router.choice.pick_prefill(req(PROMPT), set(), hashes).worker_id == "p-1"


def test_conditional_disaggregation_by_the_decode_workers_cache() -> None:
    router = indexed_router(policy="load_balance", threshold=8, n_decode=2)
    index = router.choice.kv_index
    assert index is not None
    hashes = router.choice.block_hashes(req(PROMPT))
    assert router.choice.local_prefill_worker(req(PROMPT), hashes) is None  # nothing cached
    index.apply("d-1", [KVEvent("stored", "device", "full", hashes_of(router, PROMPT, 3))])
    assert router.choice.local_prefill_worker(req(PROMPT), hashes) is None  # 21 - 12 = 9 > 8
    index.apply("d-1", [KVEvent("stored", "host", "full", hashes_of(router, PROMPT, 4)[3:])])
    local = router.choice.local_prefill_worker(req(PROMPT), hashes)  # 21 - 16 = 5 <= 8
    assert local is not None and local.worker_id == "d-1"  # the one holding the prefix
    # a request scoring its prompt (prompt_logprobs) reads no cache: d-1 would compute all 21
    scoring = GenerateRequest("s", PROMPT, SamplingParams(prompt_logprobs=0), time.time())
    assert router.choice.block_hashes(scoring) is None
    assert router.choice.local_prefill_worker(scoring, None) is None
    router.decode[1].outstanding = 1  # busier: the idle d-0 is chosen, and holds nothing
    assert router.choice.local_prefill_worker(req(PROMPT), hashes) is None


def test_routing_by_caches_needs_an_index() -> None:
    with pytest.raises(ValueError, match="need a KVIndex"):
        Router(slots("p", 1), slots("d", 1), policy="kv_aware")
    with pytest.raises(ValueError, match="need a KVIndex"):
        Router(slots("p", 1), slots("d", 1), local_prefill_max_tokens=4)


def test_kv_aware_weighs_the_requests_streaming_from_a_worker() -> None:
    """Aggregated mode: the worker holding a prompt's prefix does not take every request while
    another idles; the context its streaming requests hold counts (Dynamo's decode blocks)."""
    router = Router(
        [], slots("d", 2), policy="kv_aware", page_size=4, kv_index=KVIndex(["d-0", "d-1"])
    )
    index = router.choice.kv_index
    assert index is not None
    index.apply("d-0", [KVEvent("stored", "device", "full", hashes_of(router, PROMPT, 5))])
    hashes = router.choice.block_hashes(req(PROMPT))
    assert router.choice.pick_aggregated(req(PROMPT), hashes).worker_id == "d-0"
    router.decode[0].active_tokens = 3 * 25  # three requests of 25 tokens decoding there
    assert router.choice.pick_aggregated(req(PROMPT), hashes).worker_id == "d-1"


def test_kv_aware_sends_a_prompt_where_its_prefix_is_being_computed() -> None:
    """Requests sharing a prefix not cached anywhere yet (a burst, the n choices of one prompt)
    go to the worker computing it, which computes it once, not to each idle worker in turn."""
    router = indexed_router()
    choice = router.choice
    hashes = choice.block_hashes(req(PROMPT))
    first = choice.pick_prefill(req(PROMPT), set(), hashes)
    assert first is not None
    first.queued_prefill_tokens += choice.tokens_to_compute(first, req(PROMPT), hashes)
    choice.claim(first, hashes)
    for _ in range(3):  # the other choices of the prompt
        w = choice.pick_prefill(req(PROMPT), set(), hashes)
        assert w is first
        w.queued_prefill_tokens += choice.tokens_to_compute(w, req(PROMPT), hashes)
        choice.claim(w, hashes)
    assert first.queued_prefill_tokens == 21 + 3 * 1  # the prompt once, then one token each
    other = req([9] * 21)  # another prompt goes to the idle worker
    assert choice.pick_prefill(other, set(), choice.block_hashes(other)) is not first
    for _ in range(4):
        choice.release(first, hashes)
    assert not first.pending


def test_prefix_aware_moves_only_the_prefixes_of_a_worker_that_left() -> None:
    p = slots("p", 3)
    router = Router(p, slots("d", 1), policy="prefix_aware", page_size=4)
    prompts = [[k, k + 1, k + 2, k + 3, 0] for k in range(0, 600, 4)]
    before = {i: router.choice.pick_prefill(req(t), set()).worker_id for i, t in enumerate(prompts)}
    p[2].healthy = False
    after = {i: router.choice.pick_prefill(req(t), set()).worker_id for i, t in enumerate(prompts)}
    moved = {i for i in before if before[i] != after[i]}
    assert moved == {i for i in before if before[i] == "p-2"}
    assert len({before[i] for i in before}) == 3  # (all three preferred by some)
