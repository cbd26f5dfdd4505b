"""Logprobs at the HTTP edge (cluster/openai_logprobs.py) over a real decode worker: the
completions endpoint's shape and the chat endpoint's, whole and streamed, and what a body may ask."""

from __future__ import annotations

from typing import Any

from tests.cluster.test_server import CHAT, MODEL, backend, events, http  # noqa: F401 (fixtures)

PROMPT = {"model": MODEL, "prompt": "The capital of France is", "temperature": 0}


def streamed_logprobs(chunks: list[dict[str, Any]]) -> dict[str, list[Any]]:
    joined: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for c in chunks:
        for choice in c["choices"]:
            for key in joined:
                joined[key] += choice["logprobs"][key]
    return joined


def test_completions_logprobs_whole_and_streamed(http) -> None:  # noqa: F811
    body = PROMPT | {"max_tokens": 5, "ignore_eos": True, "logprobs": 2}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(choice["token_ids"]) == 5
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        # greedy: the sampled token is the most likely one, among the two asked for
        assert value <= 0 and top[token] == value == max(top.values()) and len(top) == 2
    chunks = events(http.post("/v1/completions", json=body | {"stream": True}).text)
    assert streamed_logprobs(chunks) == {
        k: lp[k] for k in ("tokens", "token_logprobs", "text_offset")
    }
    plain = http.post("/v1/completions", json=PROMPT | {"max_tokens": 2}).json()
    assert plain["choices"][0]["logprobs"] is None


def test_chat_logprobs_whole_and_streamed(http) -> None:  # noqa: F811
    body = CHAT | {"max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 4
    assert "".join(c["token"] for c in content) == choice["message"]["content"]
    for c in content:
        assert c["bytes"] == list(c["token"].encode()) and len(c["top_logprobs"]) == 3
        assert c["top_logprobs"][0]["logprob"] == c["logprob"]  # (greedy)
    chunks = events(http.post("/v1/chat/completions", json=body | {"stream": True}).text)
    streamed = [
        c
        for chunk in chunks
        for ch in chunk["choices"]
        if ch["logprobs"]
        for c in ch["logprobs"]["content"]
    ]
    assert streamed == content
    # top_logprobs 0 asks nothing, with or without logprobs (vLLM's rule)
    assert (
        http.post(
            "/v1/chat/completions", json=CHAT | {"max_tokens": 1, "top_logprobs": 0}
        ).status_code
        == 200
    )
    only = http.post("/v1/chat/completions", json=CHAT | {"max_tokens": 2, "logprobs": True})
    assert all(c["top_logprobs"] == [] for c in only.json()["choices"][0]["logprobs"]["content"])


def test_what_a_body_may_ask_of_logprobs(http) -> None:  # noqa: F811
    for path, body, param in (
        ("/v1/chat/completions", CHAT | {"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ("/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/completions", PROMPT | {"logprobs": 21}, "logprobs"),
        ("/v1/completions", PROMPT | {"echo": True, "logprobs": 1}, "echo"),  # prompt logprobs
    ):
        r = http.post(path, json=body | {"max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.text
