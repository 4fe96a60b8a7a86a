"""The HTTP surface: FastAPI routes over an OpenAIServing, with OpenAI error bodies.

Every error, whatever its cause (bad JSON, a wrong type, an unknown route, a bug), answers
with `{"error": {"message", "type", "param", "code"}}` and the server stays up. A 400 says
what is wrong with the value that was sent, naming the field.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
from collections.abc import AsyncGenerator, Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kvray.deploy.openai import ChunkStream, OpenAIServing
from kvray.deploy.openapi import build_openapi
from kvray.deploy.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Health,
    HugeInt,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    error_body,
    json_kind,
)

Body = TypeVar("Body", bound=BaseModel)

_TYPES = {
    401: "invalid_request_error",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

# Paths that may be opened with `public_paths` when an API key is set; /health always is.
OPTIONAL_PUBLIC_PATHS = ("/metrics", "/openapi.json")


class ErrorJSON(JSONResponse):
    """An error body; ASCII-escaped so that no input echoed in a message can break it."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def _error(
    status: int,
    message: str,
    param: str | None = None,
    type_: str | None = None,
    code: str | int | None = None,
    headers: dict[str, str] | None = None,
) -> ErrorJSON:
    t = type_ or ("invalid_request_error" if status == 400 else _TYPES.get(status, "error"))
    body = error_body(message, t, param, status if code is None else code)
    return ErrorJSON(body, status_code=status, headers=headers)


# -- request bodies -------------------------------------------------------------------------------


def _parse_int(text: str) -> int | HugeInt:
    """JSON integers beyond Python's int-string limit become a HugeInt marker, so the
    field that holds one gets a 400 naming it (instead of a ValueError inside the parser)."""
    digits = len(text) - (text[0] == "-")
    limit = sys.get_int_max_str_digits()
    if limit and digits > limit:
        return HugeInt(digits)
    return int(text)


def _path(loc: tuple[int | str, ...]) -> str:
    """`messages[0].content` from a pydantic location, without pydantic's union tags."""
    out = ""
    for item in loc:
        if isinstance(item, int):
            out += f"[{item}]"
        elif item.isidentifier():
            out += f".{item}" if out else item
        # else a union member's tag such as 'list[int]' or 'function-after[...]'
    return out


_PROBLEMS: dict[str, str] = {
    "string_type": "must be a string",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "list_type": "must be an array",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
}
_BOUNDS = {
    "greater_than": ">",
    "greater_than_equal": ">=",
    "less_than": "<",
    "less_than_equal": "<=",
}


def describe(err: ErrorDetails) -> tuple[str | None, str]:
    """(param, message) for one pydantic error: the field, what it must be, what was sent."""
    loc = tuple(err["loc"])
    where = _path(loc) or "the request body"
    param = next((x for x in loc if isinstance(x, str) and x.isidentifier()), None)
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    got = json_kind(value)
    if isinstance(value, HugeInt):
        return param, f"{where}: {got} is far beyond any value this field accepts"
    if kind == "missing":
        return param, f"{where} is required"
    if kind in ("value_error", "assertion_error"):
        return param, f"{where}: {str(ctx.get('error', err['msg']))}"
    if kind in _PROBLEMS:
        return param, f"{where} {_PROBLEMS[kind]}; got {got}"
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()))
        return param, f"{where} must be {_BOUNDS[kind]} {bound}; got {got}"
    if kind == "literal_error":
        return param, f"{where} must be one of {ctx.get('expected')}; got {got}"
    if kind == "too_short":
        return param, f"{where} must have at least {ctx.get('min_length')} item(s); got none"
    if kind == "too_long":
        return param, f"{where} must have at most {ctx.get('max_length')} item(s)"
    return param, f"{where}: {err['msg']}; got {got}"


def _first_error(e: ValidationError) -> ErrorDetails:
    """The error to report: a too-long integer, else our own plain-words checks (a union
    reports one error per member, and the members' type errors say less than the check
    that applied), else the first."""
    errors = e.errors()
    huge = [x for x in errors if isinstance(x.get("input"), HugeInt)]
    own = [x for x in errors if x["type"] in ("value_error", "assertion_error", "missing")]
    return (huge or own or errors)[0]


def parse_json(raw: bytes) -> dict[str, Any]:
    """A request body's JSON object; raises APIError(400) for anything else."""
    try:
        data = json.loads(raw, parse_int=_parse_int)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {json_kind(data)}")
    return data


def validate(data: dict[str, Any], model: type[Body]) -> Body:
    """Validate a request body's JSON object against `model`; raises APIError(400) naming
    the field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        param, message = describe(_first_error(e))
        raise APIError(400, message, param) from None


def parse_body(raw: bytes, model: type[Body]) -> Body:
    """Validate a request body against `model`; raises APIError(400) naming the field."""
    return validate(parse_json(raw), model)


def parse_tokenize(raw: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """A /tokenize body: a text (`prompt`) or a conversation (`messages`), as in vLLM."""
    data = parse_json(raw)
    text, chat = data.get("prompt") is not None, data.get("messages") is not None
    if text and chat:
        raise APIError(
            400, "send either prompt (a text) or messages (a conversation), not both", "messages"
        )
    if not (text or chat):
        raise APIError(400, "prompt (a text) or messages (a conversation) is required", "prompt")
    if chat:
        return validate(data, TokenizeChatRequest)
    return validate(data, TokenizeCompletionRequest)


# -- responses --------------------------------------------------------------------------------


async def _sse(events: ChunkStream[BaseModel]) -> AsyncGenerator[str, None]:
    """Server-sent events: `data: <json>` per model, then `data: [DONE]`. Once streaming has
    started, an error becomes a last event holding an error body (ASCII-escaped, as error
    bodies are), not a dropped line."""
    try:
        async for event in events:
            yield f"data: {json.dumps(event.model_dump(), ensure_ascii=False)}\n\n"
    except APIError as e:
        yield f"data: {json.dumps(error_body(e.message, e.type, e.param, e.status))}\n\n"
    except Exception as e:  # noqa: BLE001 - a bug: still a well-formed end of the stream
        body = error_body(f"internal error: {type(e).__name__}: {e}", _TYPES[500], None, 500)
        yield f"data: {json.dumps(body)}\n\n"
    yield "data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """A server-sent event stream whose source is closed however the response ends (a
    client that went away included), so the requests behind it end then: not whenever a
    generator happens to be garbage-collected."""

    def __init__(self, events: ChunkStream[BaseModel]) -> None:
        self._source = events
        self._events = _sse(events)
        super().__init__(self._events, media_type="text/event-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
            await self._source.aclose()  # also when the events never started


def _respond(result: BaseModel | ChunkStream[BaseModel]) -> Response:
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump())
    return _EventStream(result)


# -- ASGI middleware ------------------------------------------------------------------------------


@dataclass
class ServerState:
    """What the process that runs the app knows about it: requests in flight (streams
    count until their last byte) and whether it is draining for a shutdown."""

    inflight: int = 0
    draining: bool = False


class _Front:
    """Outermost layer (plain ASGI, so streams pass straight through): serves `/x/` as `/x`
    (no redirect), refuses new requests while draining, checks the API key, and counts
    requests in flight."""

    def __init__(
        self, app: FastAPI, state: ServerState, api_key: str | None, open_paths: set[str]
    ) -> None:
        self.app = app
        self.state = state
        self.api_key = api_key
        self.open_paths = open_paths

    def add_exception_handler(self, exc: Any, handler: Any) -> None:
        self.app.add_exception_handler(exc, handler)  # Serve registers its own errors

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if len(path) > 1 and path.endswith("/"):
            scope = {**scope, "path": path.rstrip("/") or "/"}
            scope["raw_path"] = scope["path"].encode()
        refusal = self._refusal(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        self.state.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.inflight -= 1

    def _refusal(self, scope: Scope) -> Response | None:
        if self.state.draining:
            return _error(503, "the server is shutting down", headers={"Connection": "close"})
        if not self.api_key or scope["path"] in self.open_paths:
            return None
        given = _key_given(scope)
        if given is not None and hmac.compare_digest(given.encode(), self.api_key.encode()):
            return None
        message = (
            "You didn't provide an API key: send Authorization: Bearer <key>"
            if given is None
            else "Incorrect API key provided"
        )
        return _error(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _key_given(scope: Scope) -> str | None:
    """The bearer token of the request; "" for another scheme, None when there is none."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            header = value.decode("latin-1")
            return header[7:] if header.lower().startswith("bearer ") else ""
    return None


def create_app(
    serving: OpenAIServing,
    registry: CollectorRegistry,
    api_key: str | None = None,
    health: Callable[[], Awaitable[bool]] | None = None,
    public_paths: Collection[str] = (),
    state: ServerState | None = None,
    allowed_origins: Collection[str] = (),
) -> ASGIApp:
    """The ASGI app. With `api_key`, every path but /health (and `public_paths`, a subset
    of OPTIONAL_PUBLIC_PATHS) needs `Authorization: Bearer <key>`. `allowed_origins`: the
    origins browsers may call it from (CORS; none by default). A CORS preflight is answered
    before the key is checked (browsers send it without credentials), and every answer to
    an allowed origin carries the CORS headers, errors included."""
    unknown = set(public_paths) - set(OPTIONAL_PUBLIC_PATHS)
    if unknown:
        raise ValueError(f"public_paths may hold only {OPTIONAL_PUBLIC_PATHS}, not {unknown}")
    open_paths = {"/health", *public_paths}
    app = FastAPI(title="kvray", docs_url=None, redoc_url=None, openapi_url=None)
    app.router.redirect_slashes = False  # _Front serves /x/ as /x instead
    openapi = build_openapi(
        serving.model_name,
        bool(api_key),
        public_paths,
        serving.limits.vocab_size,
        serving.model_names[1:],
    )

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> Response:
        return _error(e.status, e.message, e.param, e.type)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> Response:
        return _error(e.status_code, str(e.detail), headers=dict(e.headers or {}))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> Response:
        return _error(500, f"internal error: {type(e).__name__}: {e}")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse_body(await request.body(), CompletionRequest)
        return _respond(await serving.completions(req))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = parse_body(await request.body(), ChatCompletionRequest)
        return _respond(await serving.chat(req))

    @app.get("/v1/models")
    async def models() -> Response:
        return _respond(serving.models())

    @app.get("/v1/models/{model:path}")  # a model's name may hold slashes (org/name)
    async def model(model: str) -> Response:
        return _respond(serving.model(model))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return _respond(serving.tokenize(parse_tokenize(await request.body())))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = parse_body(await request.body(), DetokenizeRequest)
        return _respond(serving.detokenize(req))

    @app.get("/version")
    async def version() -> Response:
        return _respond(serving.version())

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' probes
    async def healthz() -> Response:
        if health is not None and not await health():
            return _error(
                503, "no engine can serve: no engine is progressing and the probe step failed"
            )
        return _respond(Health(status="ok"))

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await asyncio.to_thread(generate_latest, registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/openapi.json")
    async def openapi_json() -> JSONResponse:
        return JSONResponse(openapi)

    front: ASGIApp = _Front(app, state or ServerState(), api_key, open_paths)
    if allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        front = CORSMiddleware(
            front,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST", "HEAD", "OPTIONS"],
            allow_headers=["*"],  # Authorization, Content-Type, OpenAI's X-Stainless-*
            max_age=600,
        )
    return front
