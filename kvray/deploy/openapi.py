"""The published contract: an OpenAPI 3.1 document generated from the pydantic request and
response models in `protocol.py`, so it cannot drift from what the server validates and
sends.

A streamed response (`"stream": true`) is `text/event-stream`: one `data: <json>` line per
event, then `data: [DONE]`. Its schema describes one event the way OpenAPI 3.2 reads
event streams (and JSON Schema 2020-12 already can): an object whose `data` is either
`[DONE]` or a JSON document (`contentMediaType` / `contentSchema`) that is a chunk or, once,
an error body.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kvray.deploy.protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    VersionResponse,
)
from kvray.deploy.settings import served_names

_REF = "#/components/schemas/{model}"
_ERRORS = {
    "400": "Invalid request: the message names the field and what is wrong with it",
    "401": "Missing or wrong API key (code `invalid_api_key`)",
    "404": "Unknown model",
    "500": "Internal error (a bug: please report it)",
    "503": "No engine can serve the request (starting, failed or shutting down)",
}
_HEALTH = (
    "200 when every engine is busy and its step loop progressed within the health timeout "
    "(`--health-timeout-s`; nothing is queued behind its work); otherwise when a one-token "
    "request through an engine generates within that timeout. 503 otherwise: an engine "
    "that is dead, or stuck (work but no step), is not healthy."
)


def _this_server(
    schemas: dict[str, Any], model_names: Sequence[str], vocab_size: int | None
) -> None:
    """What only this server knows: the one model it serves (under one name or several),
    the vocabulary's bounds, and that a prompt is never empty."""
    named = {"const": model_names[0]} if len(model_names) == 1 else {"enum": list(model_names)}
    for name in (
        "CompletionRequest",
        "ChatCompletionRequest",
        "TokenizeCompletionRequest",
        "TokenizeChatRequest",
        "DetokenizeRequest",
    ):
        model = schemas[name]["properties"]["model"]
        model["anyOf"] = [named, {"type": "null"}]
    token = {"type": "integer", "minimum": 0}
    if vocab_size is not None:
        token["maximum"] = vocab_size - 1
    schemas["DetokenizeRequest"]["properties"]["tokens"]["items"] = token
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]
    prompt["anyOf"] = [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        {"type": "array", "items": token, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": token, "minItems": 1}, "minItems": 1},
        {"type": "null"},
    ]


def build_openapi(
    model_name: str,
    secured: bool,
    public_paths: Collection[str] = (),
    vocab_size: int | None = None,
    aliases: Sequence[str] = (),
) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the kvray server. `secured`: an API key is required
    everywhere but /health and `public_paths`. With `vocab_size`, token ids are bounded.
    `aliases`: the model's other names a request may give."""
    wanted: list[tuple[type[BaseModel], Any]] = [
        (CompletionRequest, "validation"),
        (ChatCompletionRequest, "validation"),
        (Completion, "serialization"),
        (ChatCompletion, "serialization"),
        (ChatCompletionChunk, "serialization"),
        (ModelList, "serialization"),
        (ModelCard, "serialization"),
        (ErrorResponse, "serialization"),
        (Health, "serialization"),
        (TokenizeCompletionRequest, "validation"),
        (TokenizeChatRequest, "validation"),
        (DetokenizeRequest, "validation"),
        (TokenizeResponse, "serialization"),
        (DetokenizeResponse, "serialization"),
        (VersionResponse, "serialization"),
    ]
    names, defs = models_json_schema(wanted, ref_template=_REF)
    schemas = defs.get("$defs", {})
    _this_server(schemas, served_names(model_name, aliases), vocab_size)

    def ref(model: type[BaseModel], mode: str = "serialization") -> dict[str, Any]:
        return names[(model, mode)]

    error = {"application/json": {"schema": ref(ErrorResponse)}}
    errors = {code: {"description": text, "content": error} for code, text in _ERRORS.items()}

    def generation(
        summary: str, request: type[BaseModel], whole: type[BaseModel], chunk: type[BaseModel]
    ) -> dict[str, Any]:
        event = {
            "type": "object",
            "description": (
                "One server-sent event. The stream ends with `data: [DONE]`; a failure "
                "after streaming began is one last event holding an error body."
            ),
            "required": ["data"],
            "properties": {
                "data": {
                    "anyOf": [
                        {"const": "[DONE]"},
                        {
                            "type": "string",
                            "contentMediaType": "application/json",
                            "contentSchema": {"anyOf": [ref(chunk), ref(ErrorResponse)]},
                        },
                    ]
                }
            },
        }
        return {
            "post": {
                "summary": summary,
                "operationId": summary.lower().replace(" ", "_"),
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": ref(request, "validation")}},
                },
                "responses": {
                    "200": {
                        "description": "The result; a stream of events when `stream` is true",
                        "content": {
                            "application/json": {"schema": ref(whole)},
                            "text/event-stream": {"schema": event},
                        },
                    },
                    **errors,
                },
            }
        }

    def get(path: str, summary: str, content: dict[str, Any]) -> dict[str, Any]:
        auth = path != "/health" and path not in public_paths
        op: dict[str, Any] = {
            "summary": summary,
            "operationId": summary.lower().replace(" ", "_"),
            "responses": {
                "200": {"description": summary, "content": content},
                **({"401": errors["401"]} if auth and secured else {}),
                "503": errors["503"],
            },
        }
        if not auth:
            op["security"] = []
        return {"get": op}

    def utility(summary: str, request: dict[str, Any], answer: type[BaseModel]) -> dict[str, Any]:
        """vLLM's /tokenize and /detokenize: a JSON body in, a JSON answer out."""
        failures = {code: errors[code] for code in ("400", "404", "500")}
        return {
            "post": {
                "summary": summary,
                "operationId": summary.lower().replace(" ", "_"),
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": request}},
                },
                "responses": {
                    "200": {
                        "description": summary,
                        "content": {"application/json": {"schema": ref(answer)}},
                    },
                    **failures,
                    **({"401": errors["401"]} if secured else {}),
                    "503": errors["503"],
                },
            }
        }

    health = get("/health", "Health", {"application/json": {"schema": ref(Health)}})
    health["get"]["description"] = _HEALTH
    retrieve = get(
        "/v1/models/{model}", "Retrieve model", {"application/json": {"schema": ref(ModelCard)}}
    )
    retrieve["get"]["parameters"] = [
        {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    ]
    retrieve["get"]["responses"]["404"] = errors["404"]

    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "kvray",
            "version": "1",
            "description": (
                f"OpenAI-compatible API serving `{model_name}`. Invalid input gets a 400 with "
                "an OpenAI error body naming the field."
            ),
        },
        "paths": {
            "/v1/completions": generation(
                "Create completion", CompletionRequest, Completion, Completion
            ),
            "/v1/chat/completions": generation(
                "Create chat completion", ChatCompletionRequest, ChatCompletion, ChatCompletionChunk
            ),
            "/v1/models": get(
                "/v1/models", "List models", {"application/json": {"schema": ref(ModelList)}}
            ),
            "/v1/models/{model}": retrieve,
            "/health": health,
            "/tokenize": utility(
                "Tokenize",
                {
                    "anyOf": [
                        ref(TokenizeCompletionRequest, "validation"),
                        ref(TokenizeChatRequest, "validation"),
                    ]
                },
                TokenizeResponse,
            ),
            "/detokenize": utility(
                "Detokenize", ref(DetokenizeRequest, "validation"), DetokenizeResponse
            ),
            "/version": get(
                "/version", "Version", {"application/json": {"schema": ref(VersionResponse)}}
            ),
            "/metrics": get(
                "/metrics",
                "Prometheus metrics",
                {"text/plain": {"schema": {"type": "string"}}},
            ),
            "/openapi.json": get(
                "/openapi.json",
                "This document",
                {"application/json": {"schema": {"type": "object"}}},
            ),
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "apiKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "the key given to `kvray serve --api-key`, when one is",
                }
            },
        },
        # Required when the server has a key; /health (and public paths) opt out per path.
        "security": [{"apiKey": []}] if secured else [],
    }
    return doc
