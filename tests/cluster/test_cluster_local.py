"""End to end on CPU: one prefill and one decode actor on a local Ray, KV over UCX on 127.0.0.1,
the official openai client against the HTTP server, transformers as the oracle."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from cluster.serve import start_cluster
from tests.cluster.cluster_fixtures import (
    get_json,
    hf_greedy_ids,
    local_config,
    wait_no_pages_held,
    worker_stats,
)
from tests.oracle import openai_penalized_greedy
from worker_common.messages import Role

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "def fibonacci(n):",
]


@pytest.fixture(scope="module")
def running() -> Any:
    rc = start_cluster(local_config(stats={"interval_s": 0.5}))
    yield rc
    rc.stop()


@pytest.fixture(scope="module")
def client(running: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def ours() -> Any:
    from engine.loaders import load_tokenizer

    return load_tokenizer("default")


def expected(
    hf: Any, tok: Any, prompt_ids: list[int], max_tokens: int
) -> tuple[str, str, list[int]]:
    ids = hf_greedy_ids(hf, prompt_ids, max_tokens, sorted(tok.stop_token_ids))
    finish = "stop" if ids and ids[-1] in tok.stop_token_ids else "length"
    return tok.decode(ids, skip_special_tokens=True), finish, ids


def test_completions_match_transformers(client, model_name, hf_gguf_model, ours) -> None:
    for prompt in PROMPTS:
        want, finish, want_ids = expected(hf_gguf_model, ours, ours.encode(prompt), 20)
        r = client.completions.create(model=model_name, prompt=prompt, max_tokens=20, temperature=0)
        assert r.choices[0].token_ids == want_ids, prompt  # our extension field, as vLLM's
        assert r.choices[0].text == want, prompt
        assert r.choices[0].finish_reason == finish
        assert r.usage.prompt_tokens == len(ours.encode(prompt))
        streamed = client.completions.create(
            model=model_name, prompt=prompt, max_tokens=20, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in streamed if c.choices) == want


def test_n_greedy_choices_through_prefill_and_decode_are_transformers(
    client, model_name, hf_gguf_model, ours
) -> None:
    """OpenAI's n with the official client, over the disaggregated path: every choice of a
    greedy request is transformers' answer (each choice is its own request to P and D)."""
    want, _, want_ids = expected(hf_gguf_model, ours, ours.encode(PROMPTS[0]), 8)
    r = client.completions.create(
        model=model_name, prompt=PROMPTS[0], max_tokens=8, temperature=0, n=2
    )
    assert [(c.index, c.text, c.token_ids) for c in r.choices] == [
        (0, want, want_ids),
        (1, want, want_ids),
    ]
    assert r.usage.completion_tokens == 2 * len(want_ids)


def test_min_tokens_through_prefill_and_decode_is_transformers_min_new_tokens(
    client, model_name, hf_gguf_model, ours
) -> None:
    """vLLM's min_tokens over the disaggregated path (P samples the first token, D the rest):
    the stop ids stay masked until then, as transformers' min_new_tokens masks them."""
    prompt_ids = ours.encode(PROMPTS[2])
    free = hf_greedy_ids(hf_gguf_model, prompt_ids, 8, sorted(ours.stop_token_ids))
    stop = free[1]  # greedy's second token, as a stop token
    want = hf_greedy_ids(hf_gguf_model, prompt_ids, 8, sorted({*ours.stop_token_ids, stop}), 5)
    r = client.completions.create(
        model=model_name,
        prompt=PROMPTS[2],
        max_tokens=8,
        temperature=0,
        extra_body={"min_tokens": 5, "stop_token_ids": [stop]},
    )
    assert r.choices[0].token_ids == want and len(want) >= 5


def test_penalties_through_prefill_and_decode_are_transformers_and_openais(
    client, model_name, hf_gguf_model, ours
) -> None:
    """The penalties over the disaggregated path (P samples the first token from the prompt's
    counts, D the rest from prompt and output): repetition_penalty as transformers' processor,
    presence and frequency as OpenAI defines them (tests/oracle.py)."""
    prompt_ids = ours.encode(PROMPTS[3])
    eos = sorted(ours.stop_token_ids)
    free = hf_greedy_ids(hf_gguf_model, prompt_ids, 16, eos)
    for extra, want in (
        ({"repetition_penalty": 1.5}, hf_greedy_ids(hf_gguf_model, prompt_ids, 16, eos, 0, 1.5)),
        (
            {"presence_penalty": 0.5, "frequency_penalty": 1.0},
            openai_penalized_greedy(hf_gguf_model, prompt_ids, 16, eos, 0.5, 1.0),
        ),
    ):
        assert want != free  # (the penalties change this answer)
        r = client.completions.create(
            model=model_name, prompt=PROMPTS[3], max_tokens=16, temperature=0, extra_body=extra
        )
        assert r.choices[0].token_ids == want, extra


def test_logprobs_through_prefill_and_decode_are_the_models(
    client, model_name, hf_gguf_model, ours
) -> None:
    """The first token's logprobs come from P (with its PrefillResult), the rest from D: each is
    transformers' log-softmax of the raw logits at that position, whole and streamed; with echo
    the prompt tokens' come from P too, scored by the positions before them."""
    import torch

    body = {"model": model_name, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0}
    r = client.completions.create(**body, logprobs=2)
    choice = r.choices[0]
    prompt_ids = ours.encode(PROMPTS[0])
    with torch.inference_mode():
        logits = hf_gguf_model(torch.tensor([prompt_ids + choice.token_ids])).logits[0].float()
    want = logits[len(prompt_ids) - 1 : -1].log_softmax(dim=-1)
    got = choice.logprobs.token_logprobs
    assert len(got) == len(choice.token_ids) == 6
    for pos, (token, value) in enumerate(zip(choice.token_ids, got, strict=True)):
        assert abs(value - want[pos, token].item()) < 1e-3, pos
    streamed = [
        lp
        for chunk in client.completions.create(**body, logprobs=2, stream=True)
        for c in chunk.choices
        if c.logprobs
        for lp in c.logprobs.token_logprobs
    ]
    assert streamed == got
    echoed = client.completions.create(**body, logprobs=0, echo=True).choices[0]
    assert echoed.text == PROMPTS[0] + choice.text
    scored = echoed.logprobs.token_logprobs
    assert scored[0] is None and len(scored) == len(prompt_ids) + 6
    prompt_want = logits[: len(prompt_ids) - 1].log_softmax(dim=-1)
    for pos, token in enumerate(prompt_ids[1:]):
        assert abs(scored[pos + 1] - prompt_want[pos, token].item()) < 1e-3, pos


def test_chat_matches_transformers(client, running, model_name, hf_gguf_model, ours) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want, _, _ = expected(hf_gguf_model, ours, ours.encode_chat(messages), 24)
    r = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=24, temperature=0
    )
    assert r.choices[0].message.content == want
    assert r.usage.completion_tokens > 0
    chunks = client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    for c in chunks:
        if c.choices:
            parts.append(c.choices[0].delta.content or "")
        if c.usage:
            usage = c.usage
    assert "".join(parts) == want
    assert usage is not None and usage.completion_tokens == r.usage.completion_tokens
    # P computed the prompt for the whole answer: the stream's prompt is its full pages (16
    # tokens, configs/local.yaml) read back, said with P's first token
    page = 16
    assert usage.prompt_tokens_details.cached_tokens == page * ((usage.prompt_tokens - 1) // page)
    # OpenAI's rule, on the wire: with include_usage every other chunk says "usage": null
    body = {"model": model_name, "prompt": "Hi", "max_tokens": 3, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", running.url + "/v1/completions", json=body, timeout=60) as raw:
        events = [json.loads(line[6:]) for line in raw.iter_lines() if line.startswith("data: {")]
    assert [e["usage"] is None for e in events] == [True] * (len(events) - 1) + [False]


def test_64_concurrent_streams_then_no_page_held(running, model_name, hf_gguf_model, ours) -> None:
    prompts = [p + suffix for p in PROMPTS for suffix in ("", " Answer briefly.")]
    full = {
        p: hf_greedy_ids(hf_gguf_model, ours.encode(p), 12, sorted(ours.stop_token_ids))
        for p in prompts
    }
    jobs = [(prompts[i % len(prompts)], 1 + i % 12) for i in range(64)]

    async def one(c: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> str:
        stream = await c.completions.create(
            model=model_name, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=300
        ) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, p, m) for p, m in jobs)), 600)

    texts = asyncio.run(main())
    for (prompt, m), text in zip(jobs, texts):
        ids = full[prompt][:m]
        assert text == ours.decode(ids, skip_special_tokens=True), (prompt, m)
    wait_no_pages_held(running)


def test_client_disconnect_frees_pages_on_both_sides(running, model_name) -> None:
    body = {
        "model": model_name,
        "prompt": "Tell me a very long story about a dragon.",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=60) as c,
        c.stream("POST", running.url + "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                got += 1
            if got >= 3:
                break  # leaving the block closes the connection mid-stream
    wait_no_pages_held(running)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("patch", "status", "param"),
    [
        ({"model": "no-such-model"}, 404, "model"),
        ({"temperature": -1.0}, 400, "temperature"),
        ({"top_p": 0.0}, 400, "top_p"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"max_tokens": 100_000}, 400, "max_tokens"),  # beyond model.max_model_len
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": "hello " * 3000}, 400, "prompt"),
        ({"prompt": [1, 2, 49152]}, 400, "prompt"),  # the vocabulary is [0, 49152)
        ({"prompt": [5, -1]}, 400, "prompt"),
        ({"prompt": [2**40]}, 400, "prompt"),  # not even an int32
        ({"stop_token_ids": [2**33]}, 400, "stop_token_ids"),
        ({"n": 0}, 400, "n"),
        ({"n": 129}, 400, "n"),
        ({"logprobs": 21}, 400, "logprobs"),  # (at most 20)
        ({"echo": "maybe"}, 400, "echo"),  # (a bool)
        ({"prompt_logprobs": 21}, 400, "prompt_logprobs"),
        ({"best_of": 2}, 400, "best_of"),
        ({"suffix": "!"}, 400, "suffix"),
        ({"presence_penalty": 2.5}, 400, "presence_penalty"),  # (in [-2, 2])
        ({"logit_bias": {"5": -101}}, 400, "logit_bias"),
        ({"min_tokens": 17}, 400, "min_tokens"),  # (more than max_tokens)
        ({"frobnicate": 1}, 400, "frobnicate"),
        ({"stream_options": {"include_usage": True, "more": 1}}, 400, "stream_options.more"),
    ],
)
def test_bad_requests_are_4xx_and_leak_nothing(
    running, model_name, patch, status, param, stream
) -> None:
    """Refused at the edge, streamed or not, naming the field, before any worker sees it."""
    body = {"model": model_name, "prompt": "hi", "max_tokens": 4, "stream": stream} | patch
    before = {s.worker_id: s.num_iterations for s in worker_stats(running)}
    r = httpx.post(running.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err
    assert {s.worker_id: s.num_iterations for s in worker_stats(running)} == before
    wait_no_pages_held(running)


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"top_logprobs": 3}, "top_logprobs"),  # (only with logprobs: true)
        ({"audio": {"voice": "x"}}, "audio"),
        ({"max_completion_tokens": 100_000}, "max_completion_tokens"),
        (
            {"messages": [{"role": "user", "content": "hi", "tool_calls": [{"id": "1"}]}]},
            "messages[0].tool_calls",
        ),
    ],
)
def test_chat_fields_duet_does_not_implement_are_refused(running, model_name, patch, param) -> None:
    body = {"model": model_name, "messages": [{"role": "user", "content": "hi"}]} | patch
    r = httpx.post(running.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err


def test_openai_fields_that_ask_for_nothing_are_accepted(running, model_name) -> None:
    no_ops = {"n": 1, "logprobs": None, "presence_penalty": 0, "frequency_penalty": 0.0}
    r = httpx.post(
        running.url + "/v1/chat/completions",
        json={
            "model": model_name,
            "messages": [{"role": "user", "content": "hi", "name": None}],
            "max_tokens": 2,
            "tools": [],
            "tool_choice": "none",
            "response_format": {"type": "text"},
            **no_ops,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2


def test_the_api_key_is_required_but_on_health_and_metrics(running) -> None:
    from fastapi.testclient import TestClient

    from cluster.config import config_from_dict
    from cluster.serve import app_of

    # The running cluster's backend behind a second app made as `duet serve` makes its app, from
    # a config with server.api_key set (no lifespan: the backend's background tasks belong to the
    # first app).
    keyed = config_from_dict({"server": {"api_key": "s3cret"}})
    client = TestClient(app_of(keyed, running.frontend))
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer s3cre"}).status_code == 401
    ok = client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == running.frontend.model_name
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
    assert client.get("/version").status_code == 200  # (no secret in it, open as vLLM's)
    assert client.get(f"/v1/models/{running.frontend.model_name}").status_code == 401
    for drained in ("/perf_metrics", "/iteration_stats", "/transfer_stats"):  # (they were open)
        assert client.get(drained).status_code == 401, drained


def test_non_streaming_request_of_a_client_that_left_is_aborted(running, model_name) -> None:
    """A client that leaves while its long non-streaming request decodes leaves no work behind:
    the decode worker stops it (its report says abort, before max_tokens) and every page comes
    back. (The client leaves once the decode worker runs the request: a fixed client timeout let
    a slow host's request still be on its way then, which this test does not look at.)"""
    get_json(running.url, "/perf_metrics")  # drain what earlier tests left
    body = {
        "model": model_name,
        "prompt": "Tell me a very long story about a dragon.",
        "max_tokens": 1500,
        "temperature": 0,
        "ignore_eos": True,
    }

    async def leave_while_it_decodes() -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            answer = asyncio.ensure_future(http.post(running.url + "/v1/completions", json=body))
            deadline = time.monotonic() + 60
            while not any(
                s.role is Role.DECODE and s.num_running
                for s in await asyncio.to_thread(worker_stats, running)
            ):
                assert time.monotonic() < deadline and not answer.done(), "it never decoded"
                await asyncio.sleep(0.1)
            answer.cancel()  # the client goes away: httpx closes the connection
            with pytest.raises(asyncio.CancelledError):
                await answer

    asyncio.run(leave_while_it_decodes())
    deadline = time.monotonic() + 60
    records: list[dict[str, Any]] = []
    while not records:
        assert time.monotonic() < deadline, "the abandoned request was not aborted"
        records = get_json(running.url, "/perf_metrics")
        time.sleep(0.2)
    (record,) = records
    assert record["finish_reason"] == "abort" and record["output_tokens"] < 1500
    wait_no_pages_held(running)


def test_metrics_and_perf_metrics(running, client, model_name) -> None:
    get_json(running.url, "/perf_metrics")  # drain what earlier tests left
    n = 3
    shared = "Here is a long preamble that every request of this test shares, word for word. " * 3
    answers = [
        client.completions.create(
            model=model_name,
            prompt=f"{shared}Count to {i + 3}:",
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        for i in range(n)
    ]
    deadline = time.monotonic() + 30
    records: list[dict[str, Any]] = []
    while len(records) < n and time.monotonic() < deadline:
        records += get_json(running.url, "/perf_metrics")
        time.sleep(0.2)
    assert len(records) == n
    assert {r["request_id"] for r in records} == {a.id for a in answers}
    by_id = {r["request_id"]: r for r in records}
    for i, answer in enumerate(answers):
        rec = by_id[answer.id]
        # Per-request KV stats: the prompt, and what the prefill worker's prefix cache served
        # (the shared preamble's full pages, from the second request on).
        assert rec["prompt_tokens"] == answer.usage.prompt_tokens
        cached = rec["cached_tokens"]
        assert (cached == 0) if i == 0 else (16 <= cached < rec["prompt_tokens"])
        assert rec["cached_tokens_by_medium"] == ({"device": cached} if cached else {})
        assert rec["output_tokens"] == 6 and rec["finish_reason"] == "length"
        assert rec["decode_time"] > 0 and rec["prefill_time"] > 0 and rec["transfer_time"] > 0
    for rec in records:
        assert rec["prefill"] is not None and rec["decode"] is not None
        assert rec["transfer_bytes"] > 0
        assert rec["transfer_path"] == "host_shm"  # two CPU processes of one host: shared memory
        assert (
            rec["prefill"]["first_token_time"]
            <= rec["decode"]["transfer_end"]
            <= rec["decode"]["last_token_time"]
        )
    text = httpx.get(running.url + "/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    ttft = families["duet:time_to_first_token_seconds"]
    count = [s.value for s in ttft.samples if s.name.endswith("_count")]
    assert count and count[0] >= n
    # Iteration stats reach the server in the background (every stats.interval_s): after requests
    # ran, both workers' steps are there, numbered from where the last read stopped.
    deadline = time.monotonic() + 30
    iterations: list[dict[str, Any]] = []
    while {r["worker_id"] for r in iterations} != {"prefill-0", "decode-0"}:
        assert time.monotonic() < deadline, f"iteration stats seen: {len(iterations)}"
        iterations += get_json(running.url, "/iteration_stats")
        time.sleep(0.2)
    for worker_id in ("prefill-0", "decode-0"):
        steps = [r["iteration"] for r in iterations if r["worker_id"] == worker_id]
        assert steps == sorted(set(steps)) and steps[0] >= 1
        assert all(r["kv"]["groups"]["full"]["total"] > 0 for r in iterations)


def test_health_models_and_tokenize(running, model_name, hf_gguf_tokenizer) -> None:
    assert get_json(running.url, "/health")["healthy"] is True
    models = get_json(running.url, "/v1/models")
    assert models["data"][0]["id"] == model_name
    # vLLM's /tokenize and /detokenize through the server's tokenizer: transformers' ids and pieces
    tokenizer = hf_gguf_tokenizer
    text = "The capital of France is"
    body = {"model": model_name, "prompt": text, "return_token_strs": True}
    r = httpx.post(running.url + "/tokenize", json=body, timeout=30).json()
    assert r["tokens"] == tokenizer(text)["input_ids"]
    assert r["token_strs"] == tokenizer.convert_ids_to_tokens(r["tokens"])
    r = httpx.post(running.url + "/detokenize", json={"tokens": r["tokens"]}, timeout=30)
    assert r.json() == {"prompt": text}


def test_prefill_actor_killed_mid_request(running, client, model_name) -> None:
    prefill = running.handles.prefill[0].handle
    results: dict[str, Any] = {}

    def send() -> None:
        try:
            r = client.completions.create(
                model=model_name, prompt="word " * 1500, max_tokens=4, temperature=0
            )
            results["text"] = r.choices[0].text
        except openai.APIStatusError as e:
            results["error"] = e

    t = threading.Thread(target=send)
    t.start()
    time.sleep(0.3)
    ray.kill(prefill, no_restart=False)  # Ray restarts it (max_restarts)
    t.join(300)
    assert not t.is_alive()
    if "error" in results:  # a clear error is acceptable; a hang or a wrong answer is not
        assert results["error"].status_code >= 500 and results["error"].message
    else:
        assert isinstance(results["text"], str)
    # The next request is served (by the restarted prefill worker or by the decode worker's fallback).
    r = client.completions.create(
        model=model_name, prompt="The capital of France is", max_tokens=5, temperature=0
    )
    assert r.choices[0].text
    # The killed actor may still be reloading its model here: the wait covers its restart.
    wait_no_pages_held(running, timeout_s=180)


def test_a_stream_whose_decode_worker_dies_ends_with_an_error_event_then_done(
    running, model_name
) -> None:
    body = {
        "model": model_name,
        "prompt": "Tell me a very long story about a dragon.",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    decode = running.handles.decode[0].handle
    events: list[str] = []
    with (
        httpx.Client(timeout=120) as c,
        c.stream("POST", running.url + "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
            if len(events) == 3:
                ray.kill(decode, no_restart=False)  # Ray restarts it (max_restarts)
    assert events[-1] == "[DONE]"
    assert "error" in json.loads(events[-2]) and "decode worker" in events[-2]
    wait_no_pages_held(running, timeout_s=180)


def wait_restarted(actor: Any, old_pid: int, timeout_s: float = 180) -> None:
    """Until the worker ``actor`` answers from a new process (Ray restarted it; it reloads the
    model first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if ray.get(actor.stats.remote(), timeout=5).pid != old_pid:
                return
        except Exception:  # (down, or still starting)
            pass
        assert time.monotonic() < deadline, "the worker did not come back in a new process"
        time.sleep(0.5)


def test_decode_actor_restart_is_survived(running, client, model_name) -> None:
    decode = running.handles.decode[0].handle
    old_pid = ray.get(decode.stats.remote()).pid
    ray.kill(decode, no_restart=False)
    wait_restarted(decode, old_pid)
    r = client.completions.create(
        model=model_name, prompt="The capital of France is", max_tokens=5, temperature=0
    )
    assert r.choices[0].text
    wait_no_pages_held(running, timeout_s=180)


def test_a_failed_engine_step_takes_the_worker_down_and_ray_restarts_it(
    running, client, model_name
) -> None:
    """A step that raises (a bug, a device error) fails the requests in it with the reason, and
    the worker goes down instead of staying up with a dead engine and its pages held: Ray
    restarts it, and it serves again. (The prefill worker: the decode worker has used up its
    restarts in this module. Its request is not lost: the decode worker prefills it instead.)"""
    prefill = running.handles.prefill[0].handle
    old_pid = ray.get(prefill.stats.remote()).pid
    ray.get(prefill.fail_next_step_for_test.remote())
    prompt = "The capital of France is"
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=5, temperature=0)
    assert r.choices[0].text  # (prefilled locally once the prefill worker failed it)
    wait_restarted(prefill, old_pid)
    again = client.completions.create(model=model_name, prompt=prompt, max_tokens=5, temperature=0)
    assert again.choices[0].text == r.choices[0].text
    wait_no_pages_held(running, timeout_s=180)


def test_request_during_decode_restart_is_served(running, client, model_name) -> None:
    decode = running.handles.decode[0].handle
    ray.kill(decode, no_restart=False)
    # Sent while the actor restarts: the router waits for a decode worker instead of failing.
    r = client.completions.create(
        model=model_name, prompt="The capital of France is", max_tokens=5, temperature=0
    )
    assert r.choices[0].text
    wait_no_pages_held(running, timeout_s=180)
