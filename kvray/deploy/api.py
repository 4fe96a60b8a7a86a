"""The HTTP surface: FastAPI routes over an OpenAIServing, with OpenAI error bodies.

Every error, whatever its cause (bad JSON, a wrong type, an unknown route, a bug), answers
with `{"error": {"message", "type", "param", "code"}}` and the server stays up.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvray.deploy.openai import APIError, OpenAIServing
from kvray.deploy.protocol import ChatCompletionRequest, CompletionRequest, error_body

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def _error(status: int, message: str, param: str | None = None, type_: str | None = None):
    t = type_ or ("invalid_request_error" if status == 400 else _TYPES.get(status, "error"))
    return JSONResponse(error_body(message, t, param, status), status_code=status)


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"]]
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        raise APIError(400, f"{where}: {err['msg']}", param) from None


async def _sse_guard(stream: AsyncIterator[str]) -> AsyncIterator[str]:
    """Once streaming has started, an error becomes a final error event, not a dropped line."""
    try:
        async for chunk in stream:
            yield chunk
    except APIError as e:
        yield f"data: {json.dumps(error_body(e.message, e.type, e.param, e.status))}\n\n"
        yield "data: [DONE]\n\n"


def create_app(
    serving: OpenAIServing,
    registry: CollectorRegistry,
    api_key: str | None = None,
    health: Callable[[], Awaitable[bool]] | None = None,
) -> FastAPI:
    app = FastAPI(title="kvray", docs_url=None, redoc_url=None)

    @app.middleware("http")
    async def auth(request: Request, call_next: Any) -> Response:
        if api_key and request.url.path.startswith("/v1"):
            header = request.headers.get("authorization", "")
            given = header[7:] if header.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(given.encode(), api_key.encode()):
                return _error(
                    401,
                    "a valid API key is required (Authorization: Bearer ...)",
                    type_="AuthenticationError",
                )
        return await call_next(request)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return _error(e.status, e.message, e.param, e.type)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:
        return _error(500, f"internal error: {type(e).__name__}: {e}")

    async def respond(result: Any) -> Response:
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(_sse_guard(result), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await respond(await serving.completions(await _parse(request, CompletionRequest)))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await respond(await serving.chat(await _parse(request, ChatCompletionRequest)))

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(serving.models())

    @app.get("/health")
    async def healthz() -> Response:
        if health is not None and not await health():
            return _error(503, "the engine is not ready or has failed")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await asyncio.to_thread(generate_latest, registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return app
