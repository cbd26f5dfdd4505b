"""The API key (cluster/api_key_auth.py) on a bare app: the key compared whole, the scheme's name
in any case, the open paths open."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from cluster.api_key_auth import ApiKeyMiddleware


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    app.add_middleware(ApiKeyMiddleware, key="s3cret")

    @app.get("/v1/models")
    def models() -> dict:
        return {"ok": True}

    @app.get("/health")
    def health() -> dict:
        return {"ok": True}

    return TestClient(app)


@pytest.mark.parametrize("header", ["Bearer s3cret", "bearer s3cret", "BEARER  s3cret"])
def test_the_key_under_the_bearer_scheme_in_any_case_is_let_in(client, header: str) -> None:
    """RFC 9110: an authentication scheme's name is case-insensitive (a client sending
    ``bearer`` was refused)."""
    assert client.get("/v1/models", headers={"Authorization": header}).status_code == 200


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        "Bearer s3cre",
        "Bearer s3crett",
        "Basic s3cret",
        "s3cret",
        "Bearers3cret",
    ],
)
def test_anything_else_is_refused_in_openai_shape(client, header: str | None) -> None:
    headers = {} if header is None else {"Authorization": header}
    r = client.get("/v1/models", headers=headers)
    assert r.status_code == 401, header
    assert r.json()["error"]["type"] == "authentication_error"


def test_the_open_paths_need_no_key(client) -> None:
    assert client.get("/health").status_code == 200
