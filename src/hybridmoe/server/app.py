"""The app: middleware (API key, CORS, body guard, --api-prefix), error shapes, and the wiring
of each API module's routes (server/chat_completions.py, completions.py, native_completion.py,
responses_api.py, messages_api.py, tokenize_api.py, admin_api.py) to the live `Service`.

The app exists before the model is loaded: until `state.service` is set, /health answers 503
"Loading model" and every other endpoint 503 as well.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridmoe.server import (
    admin_api,
    chat_completions,
    completions,
    messages_api,
    native_completion,
    responses_api,
    tokenize_api,
)
from hybridmoe.server.cors import CorsConfig, CorsMiddleware
from hybridmoe.server.guards import BodyGuard, HeadAsGet
from hybridmoe.server.limits import DEFAULT_MAX_BODY_BYTES
from hybridmoe.server.messages_api import anthropic_error_body
from hybridmoe.server.protocol import APIError
from hybridmoe.server.service import Service
from hybridmoe.server.webui_routes import WEBUI_PUBLIC_PATHS, add_webui_routes
from hybridmoe.server.wiring import Wiring

log = logging.getLogger(__name__)

# Open without the API key, as in llama-server: health and the web UI's files (the page holds no
# data and asks for the key itself). The model list stays behind the key, as in the newest llama-server.
PUBLIC_PATHS = frozenset({"/health", "/v1/health"}) | WEBUI_PUBLIC_PATHS
ANTHROPIC_PREFIX = "/v1/messages"  # routes whose errors take Anthropic's shape


@dataclass
class ServerState:
    api_keys: list[str] = field(default_factory=list)
    metrics_enabled: bool = False
    slots_enabled: bool = True  # --no-slots: /slots answers 501
    cors: CorsConfig = field(default_factory=CorsConfig)
    service: Service | None = None
    load_error: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    sse_ping_interval: float = 30.0  # --sse-ping-interval: seconds of silence before a stream pings (<= 0: never)
    ui: bool = True  # --no-ui: no web page (its paths answer 404)
    api_prefix: str = ""  # --api-prefix: every route under this path ("/api"), nothing outside it
    ui_settings: dict[str, Any] = field(default_factory=dict)  # --ui-config: the page's defaults (/props)
    static_dir: str | None = None  # --path: files served at / in place of the chat page (public, as it is)
    responses_dir: str | None = None  # --responses-dir: stored Responses also in files (shared by replicas)

    def is_static_file(self, path: str) -> bool:
        """A file --path serves at `path` (its index.html for a directory)."""
        if self.static_dir is None or not self.ui:
            return False
        root = Path(self.static_dir).resolve()
        target = (root / path.lstrip("/")).resolve()
        if target.is_dir():
            target = target / "index.html"
        return target.is_relative_to(root) and target.is_file()


def _error(err: APIError, path: str = "") -> JSONResponse:
    body = anthropic_error_body(err) if path.startswith(ANTHROPIC_PREFIX) else err.body()
    return JSONResponse(body, status_code=err.status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    e = errs[0]
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    if e.get("type") == "json_invalid":
        return f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    param = ".".join(loc) or None
    msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), param


class _ApiPrefixMiddleware:
    """--api-prefix: `PREFIX/x` is served as `/x` (the path rewritten, so every route, key check and
    error shape sees the same paths as without a prefix); any path outside it is a 404, as in
    llama-server. The bare prefix redirects to `PREFIX/`, where the page's relative links resolve."""

    def __init__(self, app: Any, prefix: str) -> None:
        self.app = app
        self.prefix = prefix

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path == self.prefix and scope["type"] == "http":
            await RedirectResponse(self.prefix + "/", status_code=308)(scope, receive, send)
            return
        if not path.startswith(self.prefix + "/"):
            await _error(APIError(404, "Not Found", type="not_found_error"), path)(scope, receive, send)
            return
        inner = path[len(self.prefix):]
        raw = scope.get("raw_path")
        scope = {**scope, "path": inner,
                 "raw_path": raw[len(self.prefix):] if raw and raw.startswith(self.prefix.encode()) else raw}
        await self.app(scope, receive, send)


class _ApiKeyMiddleware:
    """401 unless `Authorization: Bearer KEY` (or `x-api-key`) matches; /health and the web page stay open.

    Plain ASGI rather than `@app.middleware`: it passes `receive` through untouched, so handlers
    see a client disconnect at once."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (scope["type"] == "http" and self.state.api_keys and scope["path"] not in PUBLIC_PATHS
                and not (scope["method"] in ("GET", "HEAD") and self.state.is_static_file(scope["path"]))):
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            auth = headers.get("authorization", "")
            key = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
            if not any(hmac.compare_digest(key.encode(), k.encode()) for k in self.state.api_keys):
                err = APIError(401, "Invalid API Key", type="authentication_error", code="invalid_api_key")
                await _error(err, scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(state: ServerState) -> FastAPI:
    # The OpenAPI schema is served like any route: behind the API key when one is set.
    app = FastAPI(title="hybridmoe", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.hm = state

    app.add_middleware(BodyGuard, max_bytes=state.max_body_bytes)
    app.add_middleware(HeadAsGet)
    app.add_middleware(_ApiKeyMiddleware, state=state)
    # Browser UIs call llama-server cross-origin; added last = outermost, so preflights skip the key.
    app.add_middleware(CorsMiddleware, config=state.cors)
    if state.api_prefix:
        app.add_middleware(_ApiPrefixMiddleware, prefix=state.api_prefix)  # outermost: the others see inner paths

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = _validation_message(exc)
        return _error(APIError(400, msg, param=param), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(APIError(exc.status_code, str(exc.detail), type=kind), request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"),
                      request.url.path)

    def service() -> Service:
        if state.service is None:
            if state.load_error:
                raise APIError(503, f"model failed to load: {state.load_error}", type="unavailable_error")
            raise APIError(503, "Loading model", type="unavailable_error")
        return state.service

    @app.get("/health")
    @app.get("/v1/health")
    async def health() -> Any:
        service()
        return {"status": "ok"}

    wiring = Wiring(service, state.sse_ping_interval, state)
    for api in (chat_completions, completions, native_completion, responses_api, messages_api, tokenize_api,
                admin_api):
        api.register(app, wiring)

    # llama-server's routes for other kinds of model: the same 501 a client gets from it for a
    # model without that ability, not a bare 404.
    for paths, why in _NOT_SUPPORTED:
        for path in paths:
            app.add_api_route(path, _not_supported(why), methods=["POST"], include_in_schema=False)

    if state.ui and state.static_dir is not None:
        # llama-server's --path: the directory's files in place of the page; every route above wins.
        app.mount("/", StaticFiles(directory=state.static_dir, html=True), name="static")
    elif state.ui:
        add_webui_routes(app)
    return app


_NOT_SUPPORTED = (
    (("/infill",), "Infill is not supported by this model: gpt-oss has no fill-in-the-middle tokens"),
    (("/embedding", "/embeddings", "/v1/embeddings"),
     "This server does not support embeddings: it serves generative gpt-oss models only"),
    (("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"),
     "This server does not support reranking: it serves generative gpt-oss models only"),
    (("/v1/audio/transcriptions", "/audio/transcriptions"),
     "The current model does not support audio input: gpt-oss takes text only"),
)


def _not_supported(why: str) -> Callable[[], Any]:
    async def route() -> Any:
        raise APIError(501, why, type="not_supported_error")
    return route
