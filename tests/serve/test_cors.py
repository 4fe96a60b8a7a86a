"""CORS, off unless asked (`--allowed-origins`): a browser on an allowed origin gets the
headers on every answer, errors included, and its preflight is answered before the API key
is checked (browsers send it without credentials); other origins get none. The ASGI app
runs in-process (no engine: these paths never generate)."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient

from kvray.deploy.api import create_app
from kvray.deploy.generation import EngineLimits
from kvray.deploy.openai import OpenAIServing
from kvray.models.embedded import ensure_embedded_model
from kvray.text import load_tokenizer

APP = "https://app.example"
PREFLIGHT = {
    "Origin": APP,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


class _NoEngine:
    async def generate(self, input_ids: list[int], sampling: Any) -> Any:
        raise AssertionError("these paths never reach an engine")


@pytest.fixture(scope="module")
def serving() -> OpenAIServing:
    tokenizer = load_tokenizer(ensure_embedded_model(progress=False))
    return OpenAIServing("m", tokenizer, EngineLimits(2048, 49152), _NoEngine())


def test_allowed_origins_get_cors_headers_before_the_key(serving: OpenAIServing) -> None:
    app = create_app(serving, CollectorRegistry(), api_key="k", allowed_origins=[APP])
    with TestClient(app) as c:
        r = c.options("/v1/chat/completions", headers=PREFLIGHT)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == APP
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        ok = c.get("/v1/models", headers={"Origin": APP, "Authorization": "Bearer k"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == APP
        denied = c.get("/v1/models", headers={"Origin": APP})
        assert denied.status_code == 401  # the key still guards everything but preflights
        assert denied.headers["access-control-allow-origin"] == APP  # (the page reads why)
        other = c.get(
            "/v1/models", headers={"Origin": "https://evil.example", "Authorization": "Bearer k"}
        )
        assert "access-control-allow-origin" not in other.headers
        bad = c.options("/v1/models", headers={**PREFLIGHT, "Origin": "https://evil.example"})
        assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers


def test_no_cors_unless_asked(serving: OpenAIServing) -> None:
    with TestClient(create_app(serving, CollectorRegistry())) as c:
        r = c.get("/v1/models", headers={"Origin": APP})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        assert c.options("/v1/models", headers=PREFLIGHT).status_code == 405
