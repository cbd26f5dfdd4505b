"""Acceptance through the disaggregated cluster (two prefill workers, one decode worker, KV over
shared memory): the KV host tier, KV events and kv_aware routing, conditional disaggregation.

Each worker's device pool holds 10 pages (160 tokens), its host tier many more. Four conversations
of about 85 prompt tokens each: their first turns fill the pools, so pages go to the host tiers.
Second turns with a long follow-up are prefilled on the prefill worker that served the first turn
(``router.policy: kv_aware``), partly from its host tier; those with a short follow-up are prefilled
by the decode worker itself (``router.local_prefill_max_tokens``), with no transfer. Every answer
equals transformers'. A lost KV event batch makes the router rebuild that worker's index.
/reset_prefix_cache reaches every worker, the host tiers only with reset_external.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from cluster.serve import start_cluster
from tests.cluster.cluster_fixtures import get_json, hf_greedy_ids, local_config, wait_no_pages_held

pytestmark = pytest.mark.slow

PAGE_BYTES = 30 * 2 * 16 * 3 * 64 * 4  # SmolLM2-135M in float32: 30 layers, 3 KV heads of 64
THRESHOLD = 32
TURN_TOKENS = 6
TOPICS = ["volcanoes", "the moon", "honey bees", "glaciers"]
LONG_FOLLOW_UP = (
    "Thank you. Now please write the same story again, but this time for a child of six, with "
    "simpler words and a friendly animal as the narrator."
)
SHORT_FOLLOW_UP = "Again, shorter."


def next_turn(ours: Any, text: str) -> list[int]:
    """The tokens after an answer that end it and ask ``text`` (SmolLM2's chat format)."""
    chat = f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return ours.encode(chat, add_special_tokens=False)


def conversation(topic: str) -> list[dict[str, str]]:
    """A chat (a bare text may well end at once with the end-of-turn token) whose first page is
    its own: the topic is in the system message (no page shared with another conversation)."""
    return [
        {"role": "system", "content": f"You answer questions about {topic}."},
        {
            "role": "user",
            "content": f"Tell me the story of {topic}: how people came to know about it, who "
            f"first wrote about {topic} and why, what changed once people understood it, which "
            "questions about it are still open today, and one fact about it that surprises most "
            "readers. Keep the tone light, avoid jargon, and end with a short question.",
        },
    ]


@pytest.fixture(scope="module")
def running() -> Any:
    half = {"num_cpus": 0.5, "num_gpus": 0}
    rc = start_cluster(
        local_config(
            model={"max_model_len": 160},
            prefill={"replicas": 2, "resources": half},
            decode={"resources": half},
            kvcache={"cpu_bytes": 11 * PAGE_BYTES, "host_tier_bytes": 64 * PAGE_BYTES},
            router={"policy": "kv_aware", "local_prefill_max_tokens": THRESHOLD},
            stats={"interval_s": 0.5},
        )
    )
    yield rc
    rc.stop()


@pytest.fixture(scope="module")
def ours() -> Any:
    from engine.loaders import load_tokenizer

    return load_tokenizer("default")


def complete(rc: Any, prompt: list[int]) -> tuple[str, list[int]]:
    r = httpx.post(
        rc.url + "/v1/completions",
        json={
            "model": rc.frontend.model_name,
            "prompt": prompt,
            "max_tokens": TURN_TOKENS,
            "temperature": 0,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    return body["id"], body["choices"][0]["token_ids"]


def events_caught_up(rc: Any) -> None:
    """Wait until the router's index has every worker's KV events up to now."""
    feed = rc.frontend.kv_feed
    slots = rc.handles.prefill + rc.handles.decode
    deadline = time.monotonic() + 30
    for w in slots:
        latest = ray.get(w.handle.kv_snapshot.remote(), timeout=30).seq
        while feed.feeds[w.worker_id].seq < latest:
            assert time.monotonic() < deadline, f"events of {w.worker_id} stuck"
            time.sleep(0.05)


def perf_records(rc: Any, ids: list[str]) -> dict[str, dict[str, Any]]:
    records: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + 30
    while not set(ids) <= set(records):
        assert time.monotonic() < deadline, f"perf records missing: {set(ids) - set(records)}"
        records.update({r["request_id"]: r for r in get_json(rc.url, "/perf_metrics")})
        time.sleep(0.2)
    return records


def test_host_tier_kv_aware_routing_and_local_prefill(
    running: Any, ours: Any, hf_gguf_model: Any
) -> None:
    stops = sorted(ours.stop_token_ids)
    first = [ours.encode_chat(conversation(topic)) for topic in TOPICS]
    assert all(80 <= len(p) <= 100 for p in first), [len(p) for p in first]
    get_json(running.url, "/perf_metrics")  # what start-up left
    turn1 = [complete(running, p) for p in first]
    records1 = perf_records(running, [rid for rid, _ in turn1])
    p_of = [records1[rid]["prefill"]["worker_id"] for rid, _ in turn1]
    # Equal costs (nothing cached that they share) are spread over both prefill workers.
    assert sorted(p_of) == ["prefill-0", "prefill-0", "prefill-1", "prefill-1"]

    # Second turns: conversations 0 and 1 with a long follow-up (to a prefill worker), 2 and 3
    # with a short one (prefilled on the decode worker, which holds the first turn).
    long_ids, short_ids = next_turn(ours, LONG_FOLLOW_UP), next_turn(ours, SHORT_FOLLOW_UP)
    assert len(long_ids) > THRESHOLD and len(short_ids) + 16 <= THRESHOLD
    second = [
        p + answer + (long_ids if i < 2 else short_ids)
        for i, (p, (_, answer)) in enumerate(zip(first, turn1, strict=True))
    ]
    events_caught_up(running)
    local_before = running.frontend.router.num_local_prefills
    turn2 = []
    for prompt in second:
        turn2.append(complete(running, prompt))
        events_caught_up(running)
    records2 = perf_records(running, [rid for rid, _ in turn2])
    assert running.frontend.router.num_local_prefills - local_before == 2

    for i, (rid, _) in enumerate(turn2):
        rec = records2[rid]
        if i < 2:  # routed to the prefill worker holding the conversation, partly on its host tier
            assert rec["prefill"]["worker_id"] == p_of[i]
            assert rec["cached_tokens"] >= len(first[i]) - 16
            assert rec["transfer_bytes"] > 0
        else:  # prefilled by the decode worker: no prefill worker, no transfer
            assert rec["prefill"] is None and rec["transfer_bytes"] == 0
            assert rec["decode"]["prefill_start"] is not None
            assert len(second[i]) - rec["cached_tokens"] <= THRESHOLD
    host_hits = sum(records2[rid]["cached_tokens_by_medium"].get("host", 0) for rid, _ in turn2)
    assert host_hits > 0  # second turns found pages in the host tiers

    # Every answer is transformers' greedy answer to the same prompt.
    for prompt, (_, got) in zip(first + second, turn1 + turn2, strict=True):
        assert got == hf_greedy_ids(hf_gguf_model, prompt, TURN_TOKENS, stops)

    stats = wait_no_pages_held(running)
    hosts = {s.worker_id: s.kv.groups["full"].host for s in stats}
    assert all(h is not None and h.total >= 64 for h in hosts.values())
    assert sum(h.offloaded for h in hosts.values()) > 0  # type: ignore[union-attr]
    assert sum(s.kv.reuse_host_hit_tokens for s in stats) == sum(
        h.hit_tokens  # type: ignore[union-attr]
        for h in hosts.values()
    )

    # The tier on /metrics (collected in the background: awaited) and in iteration stats.
    def host_series() -> tuple[set[str], float]:
        text = httpx.get(running.url + "/metrics", timeout=30).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        pages = families["duet:kv_cache_pages"].samples
        workers = {s.labels["worker"] for s in pages if s.labels["medium"] == "host"}
        hits = families["duet:prefix_cache_hits"].samples
        host = sum(s.value for s in hits if s.labels["medium"] == "host")
        return workers, host

    deadline = time.monotonic() + 30
    while host_series() != (set(hosts), sum(s.kv.reuse_host_hit_tokens for s in stats)):
        assert time.monotonic() < deadline, host_series()
        time.sleep(0.2)
    iterations = get_json(running.url, "/iteration_stats")
    assert any(r["kv"]["groups"]["full"]["host"]["offloaded"] > 0 for r in iterations)


def test_a_lost_event_batch_rebuilds_the_workers_index(running: Any, ours: Any) -> None:
    feed = running.frontend.kv_feed
    index = running.frontend.router.choice.kv_index
    d = running.handles.decode[0]
    events_caught_up(running)
    gaps, rebuilds = feed.feeds["decode-0"].gaps, index.rebuilds["decode-0"]
    ray.get(d.handle.drop_kv_event_batch_for_test.remote(), timeout=30)
    complete(running, ours.encode("A brand new question about rivers and the sea, never seen."))
    deadline = time.monotonic() + 30
    while feed.feeds["decode-0"].gaps == gaps:
        assert time.monotonic() < deadline, "the lost batch was never noticed"
        time.sleep(0.05)
    assert index.rebuilds["decode-0"] == rebuilds + 1
    events_caught_up(running)
    snapshot = ray.get(d.handle.kv_snapshot.remote(), timeout=30)
    held = index.workers["decode-0"].groups
    assert {m: set(h) for m, h in snapshot.blocks["full"].items()} == held["full"]


def test_reset_prefix_cache_reaches_every_worker_and_the_host_tier_when_asked(
    running: Any, ours: Any
) -> None:
    """POST /reset_prefix_cache: every worker forgets its device pages' prefixes, the host tiers
    keep theirs unless reset_external (vLLM's), the router's index follows, and a prompt asked
    before is computed afresh."""
    prompt = ours.encode_chat(conversation("tides"))
    complete(running, prompt)
    wait_no_pages_held(running)
    workers = running.handles.prefill + running.handles.decode

    def cached() -> dict[str, dict[str, int]]:
        snaps = {w.worker_id: ray.get(w.handle.kv_snapshot.remote(), timeout=30) for w in workers}
        return {w: {m: len(h) for m, h in s.blocks["full"].items()} for w, s in snaps.items()}

    before = cached()
    assert sum(c.get("device", 0) for c in before.values()) > 0
    assert sum(c.get("host", 0) for c in before.values()) > 0
    r = httpx.post(running.url + "/reset_prefix_cache", timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["workers"] == sorted(w.worker_id for w in workers)
    after = cached()
    assert all(c.get("device", 0) == 0 for c in after.values())
    assert {w: c.get("host", 0) for w, c in after.items()} == {
        w: c.get("host", 0) for w, c in before.items()
    }
    r = httpx.post(running.url + "/reset_prefix_cache?reset_external=true", timeout=60)
    assert r.status_code == 200, r.text
    assert all(sum(c.values()) == 0 for c in cached().values())
    events_caught_up(running)
    index = running.frontend.router.choice.kv_index
    assert all(not any(index.workers[w.worker_id].groups["full"].values()) for w in workers)
    rid, _ = complete(running, prompt)
    assert perf_records(running, [rid])[rid]["cached_tokens"] == 0
