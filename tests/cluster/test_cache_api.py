"""POST /reset_prefix_cache (vLLM's) at the HTTP edge, over a real decode worker: a repeated prompt
reads its cache before and nothing after; a worker where a request holds pages keeps its cache and
the answer is a 409 naming it; vLLM's reset_running_requests is refused. Through the cluster (every
worker asked, the host tier with reset_external): test_cluster_kv_tiers.py."""

from __future__ import annotations

from fastapi.testclient import TestClient

from engine.engine_core import LLMEngine
from tests.cluster.worker_backend import CHAT


def cached_tokens(client: TestClient) -> int:
    r = client.post("/v1/chat/completions", json=CHAT | {"max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_reset_forgets_what_the_cache_held(http) -> None:
    cached_tokens(http)
    assert cached_tokens(http) > 0  # the same prompt again: read from the cache
    r = http.post("/reset_prefix_cache")
    assert r.status_code == 200, r.text
    assert r.json() == {"reset": True, "workers": ["d0"]}
    assert cached_tokens(http) == 0


def test_a_worker_where_pages_are_held_keeps_its_cache(http, backend) -> None:
    cached_tokens(http)
    loop = backend.worker.loop

    def hold(engine: LLMEngine) -> None:
        assert engine.kv.allocate_slots("holder", 16)

    loop.call(hold).result(timeout=30)
    try:
        r = http.post("/reset_prefix_cache", params={"reset_external": "true"})
        assert r.status_code == 409, r.text
        assert "requests hold pages on d0" in r.json()["error"]["message"]
        assert cached_tokens(http) > 0  # nothing was forgotten
    finally:
        loop.call(lambda engine: engine.kv.free("holder")).result(timeout=30)
    assert http.post("/reset_prefix_cache").status_code == 200


def test_reset_running_requests_is_refused_not_ignored(http) -> None:
    r = http.post("/reset_prefix_cache", params={"reset_running_requests": "true"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "reset_running_requests"
