"""The HTTP edge (cluster.server, cluster.openai_schemas) in one process: the real app over a real
decode worker (aggregated mode, the embedded model) without Ray or the router, so every case is
one request. What the cluster adds is tested in test_cluster_local.py; here: what a body asks
for, what the worker is given, and the shape of what comes back (its errors: test_http_errors.py)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from engine.loaders.generation_defaults import GenerationDefaults
from tests.cluster.worker_backend import CHAT, MODEL, events


def test_chat_without_max_tokens_may_run_to_the_model_length(http, backend) -> None:
    """The chat API has no 16-token default (that is /v1/completions'): as vLLM, what fits."""
    r = http.post("/v1/chat/completions", json=CHAT | {"max_tokens": 1})
    assert r.status_code == 200, r.text
    prompt = r.json()["usage"]["prompt_tokens"]
    for body in (CHAT, CHAT | {"max_tokens": None, "max_completion_tokens": None}):
        assert http.post("/v1/chat/completions", json=body | {"stream": True}).status_code == 200
        assert backend.requests[-1].sampling.max_tokens == backend.max_model_len - prompt
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    assert r.status_code == 200 and backend.requests[-1].sampling.max_tokens == 16


def test_max_completion_tokens_wins_over_the_deprecated_max_tokens(http, backend) -> None:
    r = http.post("/v1/chat/completions", json=CHAT | {"max_tokens": 3, "max_completion_tokens": 5})
    assert r.status_code == 200 and backend.requests[-1].sampling.max_tokens == 5
    for bad in (10**6, 0):  # beyond the model; not even one
        body = CHAT | {"max_tokens": 3, "max_completion_tokens": bad}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"


def test_null_fields_take_their_defaults(http, backend) -> None:
    nulls = {k: None for k in ("temperature", "top_p", "top_k", "stream", "ignore_eos", "seed")}
    base = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    r = http.post("/v1/completions", json=base | nulls)
    assert r.status_code == 200, r.text
    s = backend.requests[-1].sampling
    assert (s.temperature, s.top_p, s.top_k, s.ignore_eos, s.seed) == (1.0, 1.0, -1, False, None)
    streamed = base | {"stream": True, "stream_options": {"include_usage": None}}
    assert http.post("/v1/completions", json=streamed).status_code == 200


def test_fields_that_ask_for_nothing_are_accepted(http) -> None:
    no_ops = {
        "user": "u-1",
        "safety_identifier": "u-1",  # (OpenAI's newer name of ``user``)
        "prompt_cache_key": "k-1",  # (the prefix cache finds shared prefixes by itself)
        "prompt_cache_retention": "24h",
        "service_tier": "auto",
        "parallel_tool_calls": True,
        "min_tokens": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "top_k": 0,  # vLLM's "off", as -1
        "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
    }
    r = http.post("/v1/chat/completions", json=CHAT | {"max_tokens": 2} | no_ops)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"min_tokens": 3, "max_tokens": 2}, "min_tokens"),  # (more than max_tokens)
        ({"repetition_penalty": 0}, "repetition_penalty"),  # (must be > 0)
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),  # (in [-100, 100])
        ({"logit_bias": {"five": 3}}, "logit_bias"),
        ({"logit_bias": {"49152": 3}}, "logit_bias"),  # (the vocabulary is [0, 49152))
        ({"service_tier": "flex"}, "service_tier"),
        ({"user": 7}, "user"),
        ({"prompt_cache_key": 7}, "prompt_cache_key"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without a stream
        ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages"),
    ],
)
def test_what_duet_cannot_honour_is_refused_by_name(http, patch, param) -> None:
    r = http.post("/v1/chat/completions", json=CHAT | {"max_tokens": 2} | patch)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.text


def test_best_of_below_n_is_refused(http) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "n": 2}
    assert http.post("/v1/completions", json=body | {"best_of": 2}).status_code == 400  # (>1)
    r = http.post("/v1/completions", json=body | {"best_of": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text
    assert "best_of: must be >= n (2), got 1" in r.json()["error"]["message"]
    assert http.post("/v1/completions", json=body | {"n": 1, "best_of": 1}).status_code == 200


def test_vllm_text_options_reach_the_worker(http, backend) -> None:
    body = CHAT | {
        "max_tokens": 2,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "include_stop_str_in_output": True,
    }
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    s = backend.requests[-1].sampling
    assert (s.skip_special_tokens, s.include_stop_str_in_output) == (False, True)
    assert s.spaces_between_special_tokens is False
    with_turn = backend.requests[-1].prompt_token_ids.tolist()
    body = CHAT | {"max_tokens": 2, "add_generation_prompt": False}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    without_turn = backend.requests[-1].prompt_token_ids.tolist()
    assert with_turn[: len(without_turn)] == without_turn and len(with_turn) > len(without_turn)


def test_text_parts_are_joined_by_new_lines(http, backend) -> None:
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "World"}]
    body = CHAT | {"max_tokens": 1, "messages": [{"role": "user", "content": parts}]}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    joined = [{"role": "user", "content": "Hello\nWorld"}]
    assert backend.requests[-1].prompt_token_ids.tolist() == backend.encode_chat(joined)


@pytest.mark.parametrize(
    ("path", "body", "prefix"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "Once upon a time"}, "cmpl-"),
        ("/v1/chat/completions", CHAT, "chatcmpl-"),
    ],
)
def test_a_stream_has_one_id_and_one_creation_time(
    http, monkeypatch, path: str, body: dict[str, Any], prefix: str
) -> None:
    """OpenAI: every chunk of a stream has the same id and timestamp (time moves on here)."""
    clock = iter(range(10**9, 10**9 + 10**6))
    monkeypatch.setattr(time, "time", lambda: float(next(clock)))
    params = {"max_tokens": 6, "ignore_eos": True, "stream": True}
    r = http.post(path, json=body | params)
    chunks = events(r.text)
    assert len(chunks) >= 6
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith(prefix)
    assert len({c["created"] for c in chunks}) == 1
    r = http.post(path, json=body | {"max_tokens": 2})
    assert r.json()["id"].startswith(prefix)


def test_the_models_sampling_defaults_fill_what_a_request_leaves_out(http, backend) -> None:
    """model.generation_config auto: the checkpoint's defaults (vLLM's --generation-config auto)
    for what the body leaves out or sends as null; what it sends wins."""
    backend.sampling_defaults = GenerationDefaults(
        temperature=0.6, top_p=0.9, top_k=20, max_tokens=7
    )
    try:
        assert http.post("/v1/chat/completions", json=CHAT | {"top_p": None}).status_code == 200
        s = backend.requests[-1].sampling
        assert (s.temperature, s.top_p, s.top_k, s.max_tokens) == (0.6, 0.9, 20, 7)
        body = CHAT | {"temperature": 0, "top_p": 0.5, "top_k": -1, "max_tokens": 3}
        assert http.post("/v1/chat/completions", json=body).status_code == 200
        s = backend.requests[-1].sampling
        assert (s.temperature, s.top_p, s.top_k, s.max_tokens) == (0.0, 0.5, -1, 3)
        # /v1/completions keeps OpenAI's 16 (as in vLLM, whose default there is the request's)
        assert (
            http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}).status_code == 200
        )
        assert backend.requests[-1].sampling.max_tokens == 16
    finally:
        backend.sampling_defaults = GenerationDefaults()


def test_stop_strings_without_a_tokenizer_are_refused(http, backend) -> None:
    """A model of random weights makes no text, so a stop string could never match: refused by
    name, not accepted and ignored. Stop token ids still work."""
    backend.has_tokenizer = False
    try:
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}
        r = http.post("/v1/completions", json=body | {"stop": ["x"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
        assert "use stop_token_ids" in r.json()["error"]["message"]
        assert http.post("/v1/completions", json=body | {"stop_token_ids": [5]}).status_code == 200
    finally:
        backend.has_tokenizer = True


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stop_lists_are_bounded(http, path: str) -> None:
    """Every stop string and stop token id is checked against each generated token in the step
    every running request waits for: a request may name 64 and 1024, not more."""
    from cluster.openai_schemas import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

    body = {"model": MODEL, "max_tokens": 1}
    body |= (
        {"prompt": "Hi"}
        if "chat" not in path
        else {"messages": [{"role": "user", "content": "Hi"}]}
    )
    for field, most, item in (
        ("stop", MAX_STOP_STRINGS, "zq"),
        ("stop_token_ids", MAX_STOP_TOKEN_IDS, 7),
    ):
        assert http.post(path, json=body | {field: [item] * most}).status_code == 200, field
        r = http.post(path, json=body | {field: [item] * (most + 1)})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(field), r.text
    assert http.post(path, json=body | {"stop": "one string"}).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_stop_reason_names_what_stopped_the_answer(http, path: str, stream: bool) -> None:
    """As vLLM's stop_reason in each choice: the stop token id or stop string, None for length
    (and on every chunk before the last)."""
    body = (CHAT if "chat" in path else {"model": MODEL, "prompt": "The capital of France is"}) | {
        "temperature": 0,
        "ignore_eos": True,
        "max_tokens": 6,
    }
    free = http.post(path, json=body).json()
    tokens = free["choices"][0]["token_ids"] if "token_ids" in free["choices"][0] else None
    if tokens is None:  # (chat bodies carry no ids: take them from a completion-shaped stream)
        chunks = events(http.post(path, json=body | {"stream": True}).text)
        tokens = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    text = free["choices"][0].get("text") or free["choices"][0]["message"]["content"]
    assert free["choices"][0]["stop_reason"] is None and len(tokens) == 6

    def ending(extra: dict[str, Any]) -> tuple[str, Any]:
        r = http.post(path, json=body | extra | {"stream": stream})
        assert r.status_code == 200, r.text
        if not stream:
            choice = r.json()["choices"][0]
            return choice["finish_reason"], choice["stop_reason"]
        choices = [ch for c in events(r.text) for ch in c["choices"]]
        assert all(ch["stop_reason"] is None for ch in choices[:-1])
        return choices[-1]["finish_reason"], choices[-1]["stop_reason"]

    assert ending({"stop_token_ids": [tokens[3]]}) == ("stop", tokens[3])
    stop = text.strip()[2:5]  # (three characters inside the answer)
    assert ending({"stop": [stop]}) == ("stop", stop)
    assert ending({}) == ("length", None)


def test_chat_continues_the_final_message_and_takes_template_variables(http, backend) -> None:
    """vLLM's continue_final_message (the prompt ends inside the last message, for the model to go
    on with it) and chat_template_kwargs (template variables)."""
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Bonjour, je"}]
    body = {"model": MODEL, "messages": conv, "max_tokens": 2, "temperature": 0}
    r = http.post(
        "/v1/chat/completions",
        json=body | {"add_generation_prompt": False, "continue_final_message": True},
    )
    assert r.status_code == 200, r.text
    want = backend.tokenizer.apply_chat_template(conv, False, continue_final_message=True)
    assert want.endswith("Bonjour, je")
    assert backend.requests[-1].prompt_token_ids.tolist() == backend.encode_chat(
        conv, False, continue_final_message=True
    )
    r = http.post("/v1/chat/completions", json=body | {"continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    assert http.post("/v1/chat/completions", json=body | kwargs).status_code == 200
    bad = {"chat_template_kwargs": {"messages": []}}  # (the template's own variable)
    r = http.post("/v1/chat/completions", json=body | bad)
    assert r.status_code == 400 and "may not be named" in r.json()["error"]["message"]


def test_n_choices_are_sampled_each_with_its_own_seed(http, backend) -> None:
    """OpenAI's n: one choice per sample, choice i as the single request with seed + i (vLLM's
    rule), streamed with each delta naming its choice; the usage counts every choice."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5, "ignore_eos": True}
    body |= {"temperature": 1.0, "seed": 7}
    r = http.post("/v1/completions", json=body | {"n": 3})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [r.request_id.rsplit("-", 1)[1] for r in backend.requests[-3:]] == ["0", "1", "2"]
    assert r.json()["usage"]["completion_tokens"] == 15
    alone = [
        http.post("/v1/completions", json=body | {"seed": 7 + i}).json()["choices"][0]
        for i in range(3)
    ]
    assert [c["token_ids"] for c in choices] == [c["token_ids"] for c in alone]
    assert len({tuple(c["token_ids"]) for c in choices}) > 1  # (the choices do differ)

    # A seed is a 64-bit signed integer (vLLM's): beyond it a 400, not a 500 when a choice's
    # seed + i left the engine's range.
    r = http.post("/v1/completions", json=body | {"n": 2, "seed": 2**64 - 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text

    chat = CHAT | {"max_tokens": 5, "ignore_eos": True, "temperature": 1.0, "seed": 7, "n": 2}
    whole = http.post("/v1/chat/completions", json=chat).json()["choices"]
    chunks = events(http.post("/v1/chat/completions", json=chat | {"stream": True}).text)
    streamed: dict[int, str] = {0: "", 1: ""}
    ends: dict[int, str] = {}
    roles = 0
    for c in chunks:
        (choice,) = c["choices"]
        roles += choice["delta"].get("role") == "assistant"
        streamed[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            ends[choice["index"]] = choice["finish_reason"]
    assert roles == 2 and ends == {0: "length", 1: "length"}
    assert [streamed[0], streamed[1]] == [c["message"]["content"] for c in whole]


def test_n_is_refused_outside_its_range(http) -> None:
    for n in (0, 129):
        r = http.post("/v1/chat/completions", json=CHAT | {"n": n})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_version_and_one_models_card(http) -> None:
    """vLLM's /version, and OpenAI's retrieve-a-model (the SDK's client.models.retrieve)."""
    import importlib.metadata

    assert http.get("/version").json() == {"version": importlib.metadata.version("duet")}
    card = http.get(f"/v1/models/{MODEL}")
    assert card.status_code == 200 and card.json() == http.get("/v1/models").json()["data"][0]
    assert 0 < card.json()["created"] <= time.time()  # (the server's start, not 0)
    other = http.get("/v1/models/org/other-model")
    assert other.status_code == 404, other.text
    assert other.json()["error"]["message"].startswith("model 'org/other-model' does not exist")
