"""Stats through the running local cluster: every buffer at -1, 0 and N, per-interval KV peaks,
no iteration record lost or duplicated under load while scrapes run, and a worker whose stats call
hangs delays no other worker's stats and loses nothing.

The cluster is configs/local.yaml with ``stats.max_stats_len`` and ``stats.perf_buffer_len`` both
set to the parametrized value and ``stats.interval_s`` short, so the server collects often.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict
from typing import Any

import httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from cluster.serve import start_cluster
from tests.cluster.cluster_fixtures import get_json, local_config, wait_no_pages_held

pytestmark = pytest.mark.slow

INTERVAL_S = 0.2
N = 3  # the bounded case


NAMESPACE = "duet-stats-test"
SERVED_AS = "duet-stats-model"


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Any:
    value = request.param
    rc = start_cluster(
        local_config(
            stats={"max_stats_len": value, "perf_buffer_len": value, "interval_s": INTERVAL_S},
            model={"served_model_name": SERVED_AS},
            ray={"namespace": NAMESPACE, "runtime_env": {"env_vars": {"DUET_TEST_MARK": "42"}}},
        )
    )
    rc.buffer_len = value
    yield rc
    rc.stop()


@pytest.mark.parametrize("cluster", [-1], indirect=True)
def test_the_cluster_runs_where_and_as_its_config_says(cluster: Any) -> None:
    """model.served_model_name names the model in the API; server.host is the address the server
    binds; ray.namespace and ray.runtime_env are the Ray job's (the workers run in it)."""
    assert get_json(cluster.url, "/v1/models")["data"][0]["id"] == SERVED_AS
    r = httpx.post(
        cluster.url + "/v1/completions",
        json={"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 1},
        timeout=60,
    )
    assert r.status_code == 404 and SERVED_AS in r.json()["error"]["message"]
    host = cluster._server.servers[0].sockets[0].getsockname()[0]
    assert host == cluster.handles.config.server.host == "127.0.0.1"
    context = ray.get_runtime_context()
    assert context.namespace == NAMESPACE
    assert context.runtime_env["env_vars"] == {"DUET_TEST_MARK": "42"}
    collectors = [
        a for a in ray.util.list_named_actors(all_namespaces=True) if "collector" in a["name"]
    ]
    assert [a["namespace"] for a in collectors] == [NAMESPACE]


def slots(rc: Any) -> list[Any]:
    return rc.handles.prefill + rc.handles.decode


def num_iterations(rc: Any) -> dict[str, int]:
    stats = ray.get([w.handle.stats.remote() for w in slots(rc)], timeout=30)
    return {s.worker_id: s.num_iterations for s in stats}


def settle(rc: Any) -> dict[str, int]:
    """Wait until no worker steps and the server took two more batches from each worker since;
    return each worker's number of engine steps."""
    deadline = time.monotonic() + 60
    while True:
        before = num_iterations(rc)
        polls = dict(rc.frontend.poller.polls)
        while any(rc.frontend.poller.polls[k] < polls[k] + 2 for k in polls):
            assert time.monotonic() < deadline, "the stats poller stopped taking batches"
            time.sleep(INTERVAL_S / 2)
        if num_iterations(rc) == before:
            return before
        assert time.monotonic() < deadline, "the workers kept stepping"


def complete(rc: Any, prompt: str, max_tokens: int = 4) -> str:
    r = httpx.post(
        rc.url + "/v1/completions",
        json={
            "model": rc.frontend.model_name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()["id"]


def by_worker(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        out[r["worker_id"]].append(r)
    return out


@pytest.mark.parametrize("cluster", [-1, 0, N], indirect=True)
def test_every_buffer_follows_the_rule(cluster: Any) -> None:
    """-1 keeps every record, 0 records none (nothing is sent either), N keeps the newest N: the
    engine's iteration and request stats, the transfer records, the collector, and the server's
    buffers behind /iteration_stats, /transfer_stats and /perf_metrics."""
    value = cluster.buffer_len
    settle(cluster)
    for path in ("/iteration_stats", "/transfer_stats", "/perf_metrics"):
        get_json(cluster.url, path)  # what start-up left
    ids = [complete(cluster, f"Count to {i + 3}:") for i in range(6)]
    steps = settle(cluster)
    iterations = by_worker(get_json(cluster.url, "/iteration_stats"))
    transfers = by_worker(get_json(cluster.url, "/transfer_stats"))
    perf = get_json(cluster.url, "/perf_metrics")
    collector = ray.get(cluster.handles.collector.stats.remote(), timeout=30)
    if value == 0:
        assert (iterations, transfers, perf) == ({}, {}, [])
        assert collector.ingested == 0  # disabled at the source: the workers sent nothing
    elif value == -1:
        for worker_id, k in steps.items():
            got = [r["iteration"] for r in iterations[worker_id]]
            assert got == list(range(got[0], k + 1)), worker_id  # all, once, in order
        assert [r["request_id"] for r in transfers["decode-0"]] == ids
        assert all(r["ok"] and r["bytes"] > 0 for r in transfers["decode-0"])
        assert sorted(r["request_id"] for r in perf) == sorted(ids)
    else:
        for worker_id, k in steps.items():
            assert [r["iteration"] for r in iterations[worker_id]] == list(range(k - N + 1, k + 1))
        assert [r["request_id"] for r in transfers["decode-0"]] == ids[-N:]
        assert sorted(r["request_id"] for r in perf) == sorted(ids[-N:])
        assert all(len(records) <= N for records in transfers.values())
    if value != 0:
        assert collector.ingested >= 2 * len(perf)
    wait_no_pages_held(cluster)


@pytest.mark.parametrize("cluster", [-1], indirect=True)
def test_iteration_stats_carry_the_intervals_kv_peak(cluster: Any) -> None:
    """A long prompt, then (after a few stats intervals) a short one: the short one's iteration
    stats show its own peak, not the long one's; /metrics shows the last interval's peak."""
    settle(cluster)
    get_json(cluster.url, "/iteration_stats")
    complete(cluster, "word " * 300, max_tokens=2)
    settle(cluster)
    long_peak = max(
        r["kv"]["groups"]["full"]["peak_used"] for r in get_json(cluster.url, "/iteration_stats")
    )
    time.sleep(3 * INTERVAL_S)
    complete(cluster, "Hi", max_tokens=2)
    settle(cluster)
    short = get_json(cluster.url, "/iteration_stats")
    short_peak = max(r["kv"]["groups"]["full"]["peak_used"] for r in short)
    assert long_peak >= 300 // 16 and 0 < short_peak < long_peak
    for r in short:
        group = r["kv"]["groups"]["full"]
        assert group["peak_used"] >= group["used"]
        assert group["peak_evictable"] >= group["evictable"] and group["sliding_window"] is None
        assert 0 <= group["free_low_water"] <= group["free"] - group["evictable"]

    def peaks() -> list[float]:
        text = httpx.get(cluster.url + "/metrics", timeout=30).text
        prefix = "duet:kv_cache_peak_usage_perc{"
        return [
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
        ]

    # One gauge per worker: the last complete interval's peak, back to 0 once an interval passed
    # with nothing held (a peak that never reset would stay up).
    deadline = time.monotonic() + 30
    while peaks() != [0.0, 0.0]:
        assert len(peaks()) == 2 and time.monotonic() < deadline, peaks()
        time.sleep(INTERVAL_S)
    stats = ray.get([w.handle.stats.remote() for w in slots(cluster)], timeout=30)
    assert all(s.kv_interval is not None for s in stats)
    # The per-pool-group gauges: every worker's "full" group, now and at the last interval's end.
    text = httpx.get(cluster.url + "/metrics", timeout=30).text
    families = {f.name: f.samples for f in text_string_to_metric_families(text)}
    for name in ("kv_cache_pages", "kv_cache_peak_pages", "kv_cache_free_low_water_pages"):
        series = families["duet:" + name]
        assert {(x.labels["worker"], x.labels["group"], x.labels["medium"]) for x in series} == {
            (w.worker_id, "full", "device") for w in slots(cluster)
        }, name
    held = [x.value for x in families["duet:kv_cache_pages"] if x.labels["state"] == "used"]
    assert held == [0.0, 0.0]


@pytest.mark.parametrize("cluster", [-1], indirect=True)
def test_no_record_lost_or_duplicated_under_32_streams_and_scrapes(cluster: Any) -> None:
    start = settle(cluster)
    get_json(cluster.url, "/iteration_stats")
    seen: list[dict[str, Any]] = []
    stop = threading.Event()
    scrapes = {"iteration_stats": 0, "metrics": 0}

    def scrape() -> None:
        with httpx.Client(timeout=30) as c:
            for _ in range(2000):  # bounded; the streams end long before
                if stop.is_set():
                    return
                r = c.get(cluster.url + "/iteration_stats")
                r.raise_for_status()
                seen.extend(r.json())
                scrapes["iteration_stats"] += 1
                assert c.get(cluster.url + "/metrics").status_code == 200
                scrapes["metrics"] += 1
                time.sleep(0.05)

    async def one(c: openai.AsyncOpenAI, i: int) -> str:
        stream = await c.completions.create(
            model=cluster.frontend.model_name,
            prompt=f"Tell me about the number {i}.",
            max_tokens=1 + i % 8,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def streams() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=300
        ) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(32))), 600)

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        texts = asyncio.run(streams())
    finally:
        stop.set()
        scraper.join(60)
    assert len(texts) == 32 and scrapes["iteration_stats"] > 2 and scrapes["metrics"] > 2
    end = settle(cluster)
    seen.extend(get_json(cluster.url, "/iteration_stats"))
    for worker_id, records in by_worker(seen).items():
        got = [r["iteration"] for r in records]
        assert got == list(range(start[worker_id] + 1, end[worker_id] + 1)), worker_id
    assert set(by_worker(seen)) == {"prefill-0", "decode-0"}
    wait_no_pages_held(cluster)


@pytest.mark.parametrize("cluster", [-1], indirect=True)
def test_a_worker_whose_stats_call_hangs_delays_no_other_and_loses_nothing(cluster: Any) -> None:
    start = settle(cluster)
    get_json(cluster.url, "/iteration_stats")
    decode = cluster.handles.decode[0].handle
    ray.get(decode.hold_stats_for_test.remote(True), timeout=30)
    released = False
    try:
        polls = dict(cluster.frontend.poller.polls)
        complete(cluster, "The capital of France is", max_tokens=4)
        deadline = time.monotonic() + 60
        seen: list[dict[str, Any]] = []
        # The prefill worker's records keep coming while decode-0's stats call hangs.
        while not any(r["worker_id"] == "prefill-0" for r in seen):
            assert time.monotonic() < deadline, "prefill-0's stats stopped with decode-0's"
            seen += get_json(cluster.url, "/iteration_stats")  # answers: never waits on a worker
            assert httpx.get(cluster.url + "/metrics", timeout=30).status_code == 200
            time.sleep(INTERVAL_S)
        assert cluster.frontend.poller.polls["decode-0"] <= polls["decode-0"] + 1
        assert not any(r["worker_id"] == "decode-0" for r in seen)
        ray.get(decode.hold_stats_for_test.remote(False), timeout=30)
        released = True
        end = settle(cluster)
        seen += get_json(cluster.url, "/iteration_stats")
    finally:
        if not released:
            ray.get(decode.hold_stats_for_test.remote(False), timeout=30)
    for worker_id, records in by_worker(seen).items():
        got = [r["iteration"] for r in records]
        # decode-0's steps of the request were drained into the held batch: none is lost.
        assert got == list(range(start[worker_id] + 1, end[worker_id] + 1)), worker_id
    assert end["decode-0"] > start["decode-0"]


@pytest.mark.parametrize("cluster", [-1], indirect=True)
def test_records_collected_from_a_worker_that_died_are_kept(cluster: Any) -> None:
    """What the server took from decode-0 before it died is still there after; the other worker's
    records keep coming. (Ray restarts decode-0; the wait at the end covers its reload.)"""
    start = settle(cluster)
    get_json(cluster.url, "/iteration_stats")
    complete(cluster, "The capital of France is", max_tokens=4)
    end = settle(cluster)  # decode-0's steps are in the server's buffer now, not yet read
    ray.kill(cluster.handles.decode[0].handle, no_restart=False)
    time.sleep(25 * INTERVAL_S)  # the poller meets the dead (restarting) actor meanwhile
    records = by_worker(get_json(cluster.url, "/iteration_stats"))
    for worker_id in ("prefill-0", "decode-0"):
        got = [r["iteration"] for r in records[worker_id]]
        assert got == list(range(start[worker_id] + 1, end[worker_id] + 1)), worker_id
    assert (
        not cluster.frontend.router.decode[0].healthy
        or cluster.frontend.router.decode[0].last_stats
    )
    wait_no_pages_held(cluster, timeout_s=180)
