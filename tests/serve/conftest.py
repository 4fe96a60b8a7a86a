"""Fixtures of the Serve tests: one Ray session, one kvray Serve app on the embedded model
shared by every module of this package that asks for `server`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from .serve_helpers import MAX_TOKENS_CAP, MAX_TOKENS_DEFAULT, serve_app


@pytest.fixture(scope="package")
def model_dir() -> Path:
    from kvray.models.embedded import ensure_embedded_model

    return ensure_embedded_model(progress=False)


@pytest.fixture(scope="package")
def tokenizer(model_dir: Path) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="package")
def server(ray_session: None, model_dir: Path) -> Iterator[str]:
    limits = dict(max_tokens_default=MAX_TOKENS_DEFAULT, max_tokens_cap=MAX_TOKENS_CAP)
    with serve_app(model_dir, **limits) as url:
        yield url


@pytest.fixture(scope="package")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="package")
def http(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=120) as c:
        yield c
