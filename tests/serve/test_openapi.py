"""The published contract: GET /openapi.json is a valid OpenAPI 3.1 document generated from
the pydantic models, and a property-based fuzzer (schemathesis) driven by that document
finds no 5xx and no response that breaks its documented schema, streams included."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openapi_spec_validator import validate
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from kvray.deploy.openapi import build_openapi

from .serve_helpers import FRANCE, MODEL, assert_engine_clean

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`"),
]

FUZZ_EXAMPLES = 50  # per operation
FUZZ_MAX_TOKENS = 4  # generation is the slow part: keep each fuzzed request short


@pytest.fixture(scope="module")
def document(http: httpx.Client) -> dict[str, Any]:
    r = http.get("/openapi.json")
    assert r.status_code == 200
    return r.json()


def test_document_is_valid_openapi_3_1(document: dict[str, Any]) -> None:
    assert document["openapi"].startswith("3.1")
    validate(document)  # raises on any violation of the OpenAPI 3.1 specification


def test_document_describes_every_body(document: dict[str, Any]) -> None:
    paths = document["paths"]
    schemas = document["components"]["schemas"]
    for path, request, whole, chunk in (
        ("/v1/completions", "CompletionRequest", "Completion", "Completion"),
        ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk"),
    ):
        op = paths[path]["post"]
        body = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert body.endswith(f"/{request}")
        ok = op["responses"]["200"]["content"]
        assert ok["application/json"]["schema"]["$ref"].endswith(f"/{whole}")
        data = ok["text/event-stream"]["schema"]["properties"]["data"]["anyOf"]
        assert data[0] == {"const": "[DONE]"}
        events = data[1]["contentSchema"]["anyOf"]
        assert {e["$ref"].rsplit("/", 1)[1] for e in events} == {chunk, "ErrorResponse"}
        for status in ("400", "401", "404", "503"):
            err = op["responses"][status]["content"]["application/json"]["schema"]["$ref"]
            assert err.endswith("/ErrorResponse")
    # the request bodies are the real ones: fields, bounds and nullability
    cmpl = schemas["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "n", "stream", "echo", "logprobs"} <= set(cmpl)
    assert {"type": "null"} in cmpl["stream"]["anyOf"] and {"type": "null"} in cmpl["n"]["anyOf"]
    assert schemas["CompletionRequest"]["required"] == ["prompt"]
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]
    assert set(schemas["ErrorResponse"]["properties"]) == {"error"}
    assert set(schemas["ErrorDetail"]["required"]) == {"message", "type", "param", "code"}
    assert paths["/metrics"]["get"]["responses"]["200"]["content"] == {
        "text/plain": {"schema": {"type": "string"}}
    }
    assert document["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
    assert paths["/health"]["get"]["security"] == []


def test_document_describes_the_vllm_output_extras(document: dict[str, Any]) -> None:
    """echo, return_token_ids and continuous_usage_stats, and where their output goes."""
    schemas = document["components"]["schemas"]
    boolean = [{"type": "boolean"}, {"type": "null"}]
    cmpl, chat = schemas["CompletionRequest"], schemas["ChatCompletionRequest"]
    for request in (cmpl, chat):
        for field in ("echo", "return_token_ids"):
            assert request["properties"][field]["anyOf"] == boolean, field
    assert schemas["StreamOptions"]["properties"]["continuous_usage_stats"]["anyOf"] == boolean
    # echo with logprobs is refused: the document says so
    assert cmpl["if"] == {"required": ["echo"], "properties": {"echo": {"const": True}}}
    assert cmpl["then"] == {"properties": {"logprobs": {"type": "null"}}}
    ids = {"anyOf": [{"type": "array", "items": {"type": "integer"}}, {"type": "null"}]}
    for model, fields in (
        ("CompletionChoice", ("prompt_token_ids", "token_ids")),
        ("ChatChoice", ("token_ids",)),
        ("ChatChunkChoice", ("token_ids",)),
        ("ChatCompletion", ("prompt_token_ids",)),
        ("ChatCompletionChunk", ("prompt_token_ids",)),
    ):
        for field in fields:
            published = schemas[model]["properties"][field]
            assert published["anyOf"] == ids["anyOf"], (model, field)
            assert field not in schemas[model].get("required", []), (model, field)


def test_document_describes_the_utility_endpoints(document: dict[str, Any]) -> None:
    paths = document["paths"]
    schemas = document["components"]["schemas"]
    tokenize = paths["/tokenize"]["post"]
    body = tokenize["requestBody"]["content"]["application/json"]["schema"]["anyOf"]
    assert [b["$ref"].rsplit("/", 1)[1] for b in body] == [
        "TokenizeCompletionRequest",
        "TokenizeChatRequest",
    ]
    detokenize = paths["/detokenize"]["post"]
    body = detokenize["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert body.endswith("/DetokenizeRequest")
    for op, answer in (
        (tokenize, "TokenizeResponse"),
        (detokenize, "DetokenizeResponse"),
        (paths["/version"]["get"], "VersionResponse"),
    ):
        ok = op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
        assert ok.endswith(f"/{answer}")
    for op in (tokenize, detokenize):
        assert {"400", "404", "500", "503"} <= set(op["responses"])
    assert schemas["TokenizeCompletionRequest"]["required"] == ["prompt"]
    assert schemas["TokenizeChatRequest"]["required"] == ["messages"]
    assert set(schemas["TokenizeResponse"]["required"]) == {"count", "max_model_len", "tokens"}
    tokens = schemas["DetokenizeRequest"]["properties"]["tokens"]
    assert tokens["items"] == {"type": "integer", "minimum": 0, "maximum": 49151}
    assert "health timeout" in paths["/health"]["get"]["description"]


def test_secured_document_requires_the_key() -> None:
    doc = build_openapi(MODEL, secured=True, public_paths=["/metrics"])
    validate(doc)
    assert doc["security"] == [{"apiKey": []}]
    assert doc["paths"]["/metrics"]["get"]["security"] == []
    assert "security" not in doc["paths"]["/openapi.json"]["get"]
    assert "401" in doc["paths"]["/v1/models"]["get"]["responses"]
    # the served document adds vLLM's utility endpoints, behind the key as well
    doc = build_openapi(MODEL, secured=True, public_paths=["/metrics"], vocab_size=100)
    validate(doc)
    for path, method in (("/tokenize", "post"), ("/detokenize", "post"), ("/version", "get")):
        op = doc["paths"][path][method]
        assert "401" in op["responses"] and "security" not in op, path


# -- the fuzzer -----------------------------------------------------------------------------------


def _bounded(case: Any) -> None:
    """Keep each fuzzed generation short; only the token budget is touched."""
    body = case.body
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > FUZZ_MAX_TOKENS:
            body[key] = FUZZ_MAX_TOKENS
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = FUZZ_MAX_TOKENS


CHECKS = (
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fuzz_generation_endpoint(server: str, document: dict[str, Any], path: str) -> None:
    """Bodies that follow the document and bodies that break it (schemathesis's positive
    and negative modes): never a 5xx, every response as documented, and what breaks the
    document is refused with a 4xx."""
    schema = schemathesis.openapi.from_dict(document)
    schema.config.update(base_url=server, request_timeout=120)
    operation = schema[path]["POST"]
    valid = operation.as_strategy(GenerationMode.POSITIVE).map(lambda case: (case, True))
    invalid = operation.as_strategy(GenerationMode.NEGATIVE).map(lambda case: (case, False))
    cases = st.one_of(valid, invalid)

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(drawn=cases)
    def fuzz(drawn: tuple[Any, bool]) -> None:
        case, follows_document = drawn
        if follows_document and isinstance(case.body, dict):
            # Whatever `stream` the fuzzer chose, valid bodies go out as whichever of a
            # stream and a JSON reply has been served less so far: both get fuzzed, however
            # few valid bodies the draw holds (a coin per body once left one side unserved).
            streams, replies = seen[(200, "text/event-stream")], seen[(200, "application/json")]
            case.body["stream"] = streams <= replies
        _bounded(case)
        response = case.call(timeout=120)
        kind = (response.headers.get("content-type") or [""])[0].split(";")[0]
        seen[(response.status_code, kind)] += 1
        case.validate_response(response, checks=CHECKS)

    seen: Counter[tuple[int, str]] = Counter()
    fuzz()
    # The fuzz reached both sides: served generations (JSON and streams) and refusals.
    assert seen[(200, "application/json")] and seen[(200, "text/event-stream")], seen
    assert sum(n for (status, _), n in seen.items() if status == 400) >= 10, seen


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_fuzz_utility_endpoint(server: str, document: dict[str, Any], path: str) -> None:
    """As the generation endpoints, for vLLM's utility endpoints (no generation: fast)."""
    schema = schemathesis.openapi.from_dict(document)
    schema.config.update(base_url=server, request_timeout=60)
    operation = schema[path]["POST"]
    valid = operation.as_strategy(GenerationMode.POSITIVE).map(lambda case: (case, True))
    invalid = operation.as_strategy(GenerationMode.NEGATIVE).map(lambda case: (case, False))

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(drawn=st.one_of(valid, invalid))
    def fuzz(drawn: tuple[Any, bool]) -> None:
        case, _ = drawn
        response = case.call(timeout=60)
        seen[response.status_code] += 1
        case.validate_response(response, checks=CHECKS)

    seen: Counter[int] = Counter()
    fuzz()
    assert seen[200] and seen[400], seen


def test_still_serving_after_the_fuzz(server: str) -> None:
    with httpx.Client(base_url=server, timeout=120) as c:
        r = c.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": FRANCE, "temperature": 0, "max_tokens": 24},
        )
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
    assert_engine_clean()


def test_a_model_served_under_several_names_accepts_each() -> None:
    from kvray.deploy.openapi import build_openapi

    one = build_openapi("m", secured=False)["components"]["schemas"]
    assert one["CompletionRequest"]["properties"]["model"]["anyOf"][0] == {"const": "m"}
    doc = build_openapi("m", secured=False, aliases=("org/m", "m"))
    validate(doc)
    for name in ("CompletionRequest", "ChatCompletionRequest", "DetokenizeRequest"):
        model = doc["components"]["schemas"][name]["properties"]["model"]
        assert model["anyOf"] == [{"enum": ["m", "org/m"]}, {"type": "null"}], name
