"""End to end with transfer faults: 10% of pulls fail where the real transport fails (connect,
before data, mid-data, before the ack), over UCX (``direct_copy: false``) and over shared memory,
200 requests at concurrency 32 through the official openai client. With ``on_failure:
recompute`` every request completes with transformers' greedy tokens; with ``fail`` each failed
request is a clean 5xx and every other completes; afterwards no page is held on any worker and
/metrics counts both outcomes. The UCX cluster also serves transformers' greedy text as the
shared-memory one does (tests/cluster/test_cluster_local.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.serve import start_cluster
from tests.cluster.cluster_fixtures import (
    get_json,
    hf_greedy_ids,
    local_config,
    wait_no_pages_held,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = [
    "The capital of France is",
    "List three prime numbers:",
    "def fibonacci(n):",
    "The opposite of hot is",
    "Water boils at",
    "A haiku about rain:",
    "Translate 'good morning' to French:",
    "The largest planet is",
]
REQUESTS, CONCURRENCY, MAX_TOKENS = 200, 32, 3


@pytest.fixture(scope="module")
def ours() -> Any:
    from engine.loaders import load_tokenizer

    return load_tokenizer("default")


@pytest.fixture(scope="module")
def oracle(hf_gguf_model: Any, ours: Any) -> dict[str, list[int]]:
    stops = sorted(ours.stop_token_ids)
    return {p: hf_greedy_ids(hf_gguf_model, ours.encode(p), MAX_TOKENS, stops) for p in PROMPTS}


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Any:
    path, on_failure = request.param
    config = local_config(
        transfer={
            "direct_copy": path == "host_shm",
            "on_failure": on_failure,
            "fault_injection": {"fraction": 0.1, "seed": 5},
            # Past wait_no_pages_held's 30 s: a lease that a failed pull leaves on P (one that
            # failed at "connect" never reached P) is given up by the router, under either policy.
            "lease_s": 60,
            "connect_deadline_s": 5,
            "pull_deadline_s": 5,
        },
        stats={"interval_s": 1.0},  # the server collects the workers' counters every second
    )
    running = start_cluster(config)
    running.path, running.on_failure = path, on_failure
    yield running
    running.stop()


CLUSTERS = [("ucx", "recompute"), ("ucx", "fail"), ("host_shm", "recompute"), ("host_shm", "fail")]


async def _send_all(url: str, model: str) -> list[tuple[str, Any]]:
    """Every request once; each answer is its token ids, or the APIStatusError it raised."""
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(c: openai.AsyncOpenAI, prompt: str) -> tuple[str, Any]:
        async with gate:
            try:
                r = await c.completions.create(
                    model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
                )
            except openai.APIStatusError as e:
                return prompt, e
            return prompt, r.choices[0].token_ids

    async with openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300
    ) as c:
        jobs = [one(c, PROMPTS[i % len(PROMPTS)]) for i in range(REQUESTS)]
        return await asyncio.wait_for(asyncio.gather(*jobs), 600)


def _decode_paths(url: str, timeout_s: float = 60.0) -> set[str]:
    """The data paths of the decode worker's successful pulls in /transfer_stats (the server
    collects the records every stats.interval_s: wait for some)."""
    paths: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while not paths and time.monotonic() < deadline:
        records = get_json(url, "/transfer_stats")
        paths |= {r["path"] for r in records if r["worker_id"] == "decode-0" and r["ok"]}
        time.sleep(0.5)
    return paths


def _metric(
    url: str, name: str, want: float, timeout_s: float = 30.0, role: str | None = None
) -> float:
    """The counter's value on /metrics (summed over the workers, or those of ``role``) once it
    reached ``want`` (it lags the workers by up to a stats interval), or its last value after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(url + "/metrics", timeout=30).text
        value = sum(
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == name and role in (None, s.labels.get("role"))
        )
        if value == want or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


@pytest.mark.parametrize("cluster", CLUSTERS, indirect=True, ids=lambda c: "-".join(c))
def test_injected_faults_end_as_the_failure_policy_says(cluster: Any, oracle: dict) -> None:
    model = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused").models.list().data[0].id
    answers = asyncio.run(_send_all(cluster.url, model))
    failed = [(p, a) for p, a in answers if isinstance(a, Exception)]
    for prompt, answer in answers:
        if not isinstance(answer, Exception):
            assert answer == oracle[prompt], prompt
    stats = wait_no_pages_held(cluster)  # every lease released, every receive ended
    decode = next(s.transfer for s in stats if s.role == "decode")
    injected = sum(s.transfer.injected_faults for s in stats)
    assert 5 <= injected <= 45  # 10% of 200 pulls, seeded by random request ids
    assert decode.failures == injected  # nothing else failed
    if cluster.on_failure == "recompute":
        assert failed == []
        assert (decode.recomputed, decode.failed_requests) == (injected, 0)
        assert _metric(cluster.url, "duet:kv_transfer_recomputed_total", injected) == injected
    else:
        assert len(failed) == injected
        for _, error in failed:
            assert error.status_code == 500 and "KV transfer failed" in str(error.body)
        assert (decode.failed_requests, decode.recomputed) == (injected, 0)
        assert _metric(cluster.url, "duet:kv_transfer_failed_requests_total", injected) == injected
    assert _metric(cluster.url, "duet:kv_transfer_injected_faults_total", injected) == injected
    ok = decode.transfers_ok
    assert ok > 100 and _metric(cluster.url, "duet:kv_transfers_ok_total", ok, role="decode") == ok
    assert _decode_paths(cluster.url) == {cluster.path}


@pytest.mark.parametrize(
    "cluster", [("ucx", "recompute")], indirect=True, ids=lambda c: "-".join(c)
)
def test_the_ucx_path_serves_transformers_greedy_text(
    cluster: Any, hf_gguf_model: Any, ours: Any
) -> None:
    client = openai.OpenAI(
        base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120
    )
    model = client.models.list().data[0].id
    stops = sorted(ours.stop_token_ids)
    for prompt in PROMPTS[:3]:
        want_ids = hf_greedy_ids(hf_gguf_model, ours.encode(prompt), 16, stops)
        want = ours.decode(want_ids, skip_special_tokens=True)
        r = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
        assert r.choices[0].token_ids == want_ids and r.choices[0].text == want, prompt
        streamed = client.completions.create(
            model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in streamed if c.choices) == want
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want_ids = hf_greedy_ids(hf_gguf_model, ours.encode_chat(messages), 16, stops)
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == ours.decode(want_ids, skip_special_tokens=True)
    wait_no_pages_held(cluster)
