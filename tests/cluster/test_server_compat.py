"""What a client written for vLLM's OpenAI-compatible server sends and reads, at the HTTP edge over
a real decode worker: the official ``openai`` client end to end, bodies without a model, vLLM's
extensions sent with their defaults, message names and documents for the template, text parts
under the Responses API's names, add_special_tokens, a client's request id, and context-overflow
messages that clients recognise."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.cluster.worker_backend import CHAT, MODEL, events


@pytest.fixture
def client(http) -> openai.OpenAI:
    """The official client, talking to the app through the test client (an httpx.Client)."""
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http)


def test_the_openai_client_reads_every_answer(client) -> None:
    """Whole and streamed, both endpoints, parsed by the client's own types; a reply fed back
    into the conversation as the client dumps it (refusal, annotations, ... as null) is taken."""
    messages: list[Any] = [{"role": "user", "content": "Hi"}]
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=3, temperature=0
    )
    message = answer.choices[0].message
    assert message.role == "assistant" and message.content
    assert answer.system_fingerprint is None and answer.usage.completion_tokens == 3
    assert message.model_extra == {"reasoning_content": None}
    messages += [message.model_dump(), {"role": "user", "content": "And then?"}]
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert again.choices[0].finish_reason == "length"

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3

    text = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2)
    assert text.object == "text_completion" and text.choices[0].finish_reason == "length"
    assert text.system_fingerprint is None and text.usage.total_tokens > 2


def test_a_body_without_a_model_asks_for_the_served_one(http) -> None:
    """vLLM's rule (its model field is optional); a named model must still be the served one."""
    r = http.post("/v1/chat/completions", json={"messages": CHAT["messages"], "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == MODEL, r.text
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "model": None})
    assert r.status_code == 200 and r.json()["model"] == MODEL, r.text
    r = http.post("/v1/completions", json={"prompt": "Hi", "model": "gpt-4o"})
    assert r.status_code == 404, r.text


def test_a_context_overflow_says_so_as_clients_expect(client) -> None:
    """OpenAI's and vLLM's wording: clients (LiteLLM, LangChain, agents that trim history) tell a
    context overflow from other 400s by "This model's maximum context length is N tokens"."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=10**5
        )
    assert "This model's maximum context length is 512 tokens" in e.value.message
    assert e.value.param == "max_tokens"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi " * 600, max_tokens=1)
    assert "This model's maximum context length is 512 tokens" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi", max_tokens=1)


VLLM_DEFAULTS = {
    "use_beam_search": False,
    "length_penalty": 1.0,
    "bad_words": [],
    "priority": 0,
    "guided_json": None,
    "guided_choice": None,
    "logits_processors": None,
    "cache_salt": None,
    "kv_transfer_params": None,
    "response_format": {"type": "text"},
}


def test_vllm_extensions_sent_with_their_defaults_are_accepted(http) -> None:
    chat = CHAT | {"max_tokens": 1, "include_reasoning": True, "chat_template": None}
    r = http.post("/v1/chat/completions", json=chat | VLLM_DEFAULTS)
    assert r.status_code == 200, r.text
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "prompt_embeds": None}
    r = http.post("/v1/completions", json=body | VLLM_DEFAULTS)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"use_beam_search": True}, "use_beam_search"),
        ({"priority": 1}, "priority"),
        ({"bad_words": ["x"]}, "bad_words"),
        ({"guided_choice": ["a", "b"]}, "guided_choice"),
        ({"include_reasoning": False}, "include_reasoning"),  # (no parser: it stays in content)
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"add_special_tokens": True}, "add_special_tokens"),
        ({"documents": "not a list"}, "documents"),
        ({"messages": [{"role": "user", "content": "Hi", "name": 3}]}, "messages.0.name"),
        ({"messages": [{"role": "user", "content": "Hi", "reasoning": "x"}]}, "messages[0]"),
    ],
)
def test_vllm_extensions_that_ask_for_something_are_refused(http, patch, param) -> None:
    r = http.post("/v1/chat/completions", json=CHAT | {"max_tokens": 1} | patch)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.text


def _template_calls(backend, monkeypatch) -> list[dict[str, Any]]:
    """Every encode_chat call of the server, its arguments recorded."""
    calls: list[dict[str, Any]] = []
    encode_chat = backend.encode_chat

    def recording(messages, add_generation_prompt=True, **options):
        calls.append({"messages": messages, **options})
        return encode_chat(messages, add_generation_prompt, **options)

    monkeypatch.setattr(backend, "encode_chat", recording)
    return calls


def test_names_and_documents_reach_the_chat_template(http, backend, monkeypatch) -> None:
    """As vLLM hands them on: a message's name with it, ``documents`` as the template's variable
    (chat_template_kwargs' own wins); a template that ignores them renders as without them."""
    calls = _template_calls(backend, monkeypatch)
    named = [{"role": "user", "content": "Hi", "name": "ada"}]
    docs = [{"title": "Paris", "text": "Paris is the capital of France."}]
    body = {"model": MODEL, "messages": named, "max_tokens": 1, "documents": docs}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    assert calls[-1]["messages"] == named
    assert calls[-1]["template_kwargs"] == {"documents": docs}
    assert backend.requests[-1].prompt_token_ids.tolist() == backend.encode_chat(CHAT["messages"])
    kwargs = {"chat_template_kwargs": {"documents": [], "enable_thinking": False}}
    assert http.post("/v1/chat/completions", json=body | kwargs).status_code == 200
    assert calls[-1]["template_kwargs"] == {"documents": [], "enable_thinking": False}
    assert http.post("/tokenize", json={"messages": named}).status_code == 200
    assert calls[-1]["messages"] == named


def test_responses_api_text_parts_are_text(http, backend) -> None:
    """vLLM reads input_text and output_text parts as text parts."""
    parts = [{"type": "input_text", "text": "Hello"}, {"type": "output_text", "text": "World"}]
    body = CHAT | {"max_tokens": 1, "messages": [{"role": "user", "content": parts}]}
    assert http.post("/v1/chat/completions", json=body).status_code == 200, body
    joined = [{"role": "user", "content": "Hello\nWorld"}]
    assert backend.requests[-1].prompt_token_ids.tolist() == backend.encode_chat(joined)


def test_add_special_tokens_of_a_completion_prompt(http, backend, monkeypatch) -> None:
    """vLLM's completions add_special_tokens (default true); chat accepts only its default, false."""
    seen: list[bool] = []
    encode = backend.encode

    def recording(text: str, add_special_tokens: bool = True) -> list[int]:
        seen.append(add_special_tokens)
        return encode(text, add_special_tokens)

    monkeypatch.setattr(backend, "encode", recording)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    for value in (False, True):
        r = http.post("/v1/completions", json=body | {"add_special_tokens": value})
        assert r.status_code == 200, r.text
    assert seen == [False, True]
    r = http.post(
        "/v1/chat/completions", json=CHAT | {"max_tokens": 1, "add_special_tokens": False}
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("path", "prefix"), [("/v1/completions", "cmpl"), ("/v1/chat/completions", "chatcmpl")]
)
def test_a_clients_request_id_names_the_answer(http, backend, path: str, prefix: str) -> None:
    """vLLM's: the answer's id is <prefix>-<X-Request-Id header, else the body's request_id>,
    streamed too; the same id sent twice still makes requests of their own."""
    body = (CHAT if "chat" in path else {"model": MODEL, "prompt": "Hi"}) | {"max_tokens": 2}
    r = http.post(path, json=body | {"request_id": "job-7"})
    assert r.json()["id"] == f"{prefix}-job-7", r.text
    first = backend.requests[-1].request_id
    r = http.post(path, json=body | {"request_id": "job-7", "stream": True})
    assert {c["id"] for c in events(r.text)} == {f"{prefix}-job-7"}
    assert backend.requests[-1].request_id != first
    assert backend.requests[-1].request_id.startswith(f"{prefix}-job-7-")
    r = http.post(path, json=body | {"request_id": "job-7"}, headers={"X-Request-Id": "trace-1"})
    assert r.json()["id"] == f"{prefix}-trace-1", r.text
    assert http.post(path, json=body).json()["id"].startswith(f"{prefix}-")
    r = http.post(path, json=body | {"request_id": "x" * 257})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", r.text
