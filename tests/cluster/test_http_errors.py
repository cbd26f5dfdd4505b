"""The HTTP edge's errors (cluster/http_errors.py) through the real app: OpenAI's error shape for
every error of the app, short messages for bodies with many bad elements, text no tokenizer takes
as a 400 naming its field."""

from __future__ import annotations

import pytest

from tests.cluster.worker_backend import MODEL


@pytest.mark.parametrize(
    ("path", "field", "param"),
    [
        ("/v1/completions", '"prompt": "\\ud83d"', "prompt"),
        (
            "/v1/chat/completions",
            '"messages": [{"role": "user", "content": "\\ud83d"}]',
            "messages",
        ),
    ],
)
def test_a_lone_surrogate_is_a_bad_request(http, path: str, field: str, param: str) -> None:
    """Valid JSON (a JS client cutting a string inside an emoji sends it), but no text a
    tokenizer takes: 400 naming the field, not a bare 500."""
    raw = f'{{"model": "{MODEL}", "max_tokens": 2, {field}}}'.encode()
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_long_prompt_with_one_bad_element_is_one_short_error(http) -> None:
    """Each element of each prompt form was an error of its own: a 1 MB body was answered with
    about 40 MB, validated for seconds on the loop that streams every other request."""
    body = {"model": MODEL, "prompt": [1] * 100_000 + ["x"], "max_tokens": 1}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400 and len(r.content) < 2000, len(r.content)
    assert r.json()["error"]["param"] == "prompt.list[int].100000", r.text
    r = http.post("/v1/completions", json=body | {"prompt": ["x"] * 50 + [1] * 50})
    assert r.status_code == 400 and "and 45 more" in r.json()["error"]["message"], r.text


def test_every_error_has_the_openai_shape(http, backend, monkeypatch) -> None:
    """Unknown routes, wrong methods, bodies that are not JSON and our own failures answer
    {"error": {...}} as vLLM does (FastAPI's {"detail": ...} and a bare text 500 did not)."""
    for method, path, code in (("get", "/v1/nope", 404), ("get", "/v1/completions", 405)):
        r = getattr(http, method)(path)
        assert r.status_code == code and r.json()["error"]["code"] == code, r.text
    r = http.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] is None, r.text
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "metadata": "y" * 10**5})
    assert r.status_code == 400 and len(r.content) < 1000, len(r.content)  # not echoed whole

    def broken(text: str, add_special_tokens: bool = True) -> list[int]:
        raise RuntimeError("the tokenizer broke")

    monkeypatch.setattr(backend, "encode", broken)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    # The kind of failure, not its text (which may carry paths, addresses, another request's
    # data): that is in the server's log.
    message = r.json()["error"]["message"]
    assert r.status_code == 500 and "RuntimeError" in message, r.text
    assert "the tokenizer broke" not in message


def test_a_long_model_name_is_not_echoed_whole(http) -> None:
    r = http.post("/v1/completions", json={"model": "m" * 10**6, "prompt": "x"})
    assert r.status_code == 404 and len(r.content) < 1000, len(r.content)
    assert "(1000000 characters)" in r.json()["error"]["message"]


def test_a_body_over_the_limit_is_refused_before_it_is_parsed(backend) -> None:
    """server.max_request_body_mb: a body over it gets a 413 in OpenAI's shape, whether its
    length is declared or it comes in chunks; one under it is served."""
    from fastapi.testclient import TestClient

    from cluster.config import config_from_dict
    from cluster.serve import app_of

    config = config_from_dict({"server": {"max_request_body_mb": 1}})
    client = TestClient(app_of(config, backend))  # (no lifespan: the fixture's app has it)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    assert client.post("/v1/completions", json=body).status_code == 200
    big = {**body, "prompt": "x " * (1 << 19)}  # 1 MiB of prompt, and the rest
    r = client.post("/v1/completions", json=big)
    assert r.status_code == 413, r.text
    assert "server.max_request_body_mb" in r.json()["error"]["message"]
    raw = httpx_json(big)

    def chunks():  # no Content-Length: the limit counts what is read
        for i in range(0, len(raw), 1 << 16):
            yield raw[i : i + (1 << 16)]

    r = client.post("/v1/completions", content=chunks(), headers=JSON)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413, r.text
    assert client.post("/v1/completions", json=body).status_code == 200  # serving goes on


JSON = {"content-type": "application/json"}


def httpx_json(body: dict) -> bytes:
    import json

    return json.dumps(body).encode()
