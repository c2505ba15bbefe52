"""FastAPI routes only: parse, call `Serving`, answer JSON / SSE / OpenAI error objects.

The app exists before the model is loaded: until `state.serving` is set, /health answers 503
"Loading model" and every other endpoint 503 as well.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridmoe.server import messages_api, responses_api
from hybridmoe.server.messages_api import MessagesInput, MessagesRequest, anthropic_error_body
from hybridmoe.server.guards import BodyGuard, HeadAsGet
from hybridmoe.server.loads import loads as engine_loads
from hybridmoe.server.limits import DEFAULT_MAX_BODY_BYTES
from hybridmoe.server.protocol import (
    APIError,
    ApplyTemplateRequest,
    ChatCompletionRequest,
    CompletionRequest,
    ControlRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from hybridmoe.server.cors import CorsConfig, CorsMiddleware
from hybridmoe.server.event_streams import with_pings
from hybridmoe.server.native_api import register_routes as register_native_routes
from hybridmoe.server.response_files import ResponseFiles
from hybridmoe.server.responses_api import ResponsesRequest, ResponseStore
from hybridmoe.server.serving import Serving
from hybridmoe.server.webui_routes import WEBUI_PUBLIC_PATHS, add_webui_routes

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
    serving: Serving | None = None
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

    def respond(result: dict[str, Any] | AsyncIterator[str], req: Any = None) -> Any:
        """A JSON answer as is; a stream as SSE with pings (the request's sse_ping_interval, else
        the server's)."""
        if isinstance(result, dict):
            return result
        own = getattr(req, "sse_ping_interval", None)
        return sse_response(result, state.sse_ping_interval if own is None else own)

    def serving() -> Serving:
        if state.serving is None:
            if state.load_error:
                raise APIError(503, f"model failed to load: {state.load_error}", type="unavailable_error")
            raise APIError(503, "Loading model", type="unavailable_error")
        return state.serving

    @app.get("/health")
    @app.get("/v1/health")
    async def health() -> Any:
        serving()
        return {"status": "ok"}

    @app.get("/v1/models")
    @app.get("/models")
    async def models() -> Any:
        return serving().models()

    @app.post("/v1/chat/completions/control")
    async def chat_control(req: ControlRequest) -> Any:
        return serving().live_chats.control(req)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Any:
        result = await serving().chat(req, request.is_disconnected)
        return respond(result, req)

    responses_store = ResponseStore(ResponseFiles(state.responses_dir) if state.responses_dir else None)

    @app.post("/v1/responses")
    @app.post("/responses")
    async def responses(req: ResponsesRequest, request: Request) -> Any:
        return respond(await responses_api.create(serving(), responses_store, req, request.is_disconnected), req)

    @app.post("/v1/responses/input_tokens")
    @app.post("/responses/input_tokens")
    async def responses_input_tokens(req: ResponsesRequest) -> Any:
        return await responses_api.input_tokens(serving(), responses_store, req)

    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, request: Request) -> Any:
        return respond(await messages_api.create(serving(), req, request.is_disconnected), req)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(req: MessagesInput) -> Any:
        return await messages_api.count_tokens(serving(), req)

    @app.post("/v1/completions")  # /completion(s) are llama-server's native API: native_api.py
    async def completions(req: CompletionRequest, request: Request) -> Any:
        result = await serving().completion(req, request.is_disconnected)
        return respond(result, req)

    # Plain `def`: FastAPI runs these in its thread pool, off the event loop.
    @app.post("/tokenize")
    def tokenize(req: TokenizeRequest) -> Any:
        return serving().tokenize(req)

    @app.post("/detokenize")
    def detokenize(req: DetokenizeRequest) -> Any:
        return serving().detokenize(req)

    @app.post("/apply-template")
    def apply_template(req: ApplyTemplateRequest) -> Any:
        return serving().apply_template(req)

    @app.get("/props")
    async def props() -> Any:
        # llama-server's switches: which endpoints answer, its web UI and the page's defaults
        return {**serving().props(), "endpoint_slots": state.slots_enabled, "endpoint_metrics": state.metrics_enabled,
                "endpoint_props": False, "cors_proxy_enabled": False, "ui": state.ui, "ui_settings": state.ui_settings}

    @app.get("/lora-adapters")
    async def lora_adapters() -> Any:  # llama-server's list; none can be loaded here
        return []

    @app.post("/lora-adapters")
    async def set_lora_adapters(adapters: list[Any]) -> Any:
        if adapters:  # llama-server answers success and ignores ids it does not have; an error is kinder
            raise APIError(400, f"no LoRA adapter is loaded (this server loads none), got {adapters[0]!r}",
                           param="adapters")
        return {"success": True}

    @app.post("/props", include_in_schema=False)
    async def set_props() -> Any:  # llama-server answers the same unless started with --props
        raise APIError(501, "This server does not support changing global properties (llama-server's --props): "
                            "restart it with the flags you want", type="not_supported_error")

    @app.get("/slots")
    async def slots(fail_on_no_slot: int = 0) -> Any:
        if not state.slots_enabled:
            raise APIError(501, "This server does not support slots endpoint. Start it with `--slots`",
                           type="not_supported_error")
        s = serving()
        info = s.slots()
        if fail_on_no_slot and all(x["is_processing"] for x in info):
            raise APIError(503, "no slot available", type="unavailable_error")
        return info

    @app.get("/slots/{id_slot}", include_in_schema=False)
    async def slot_get(id_slot: str) -> Any:  # llama-server has no such route: 404, not our 405
        raise StarletteHTTPException(404, "Not Found")

    @app.post("/slots/{id_slot}")
    def slot_action(id_slot: int, action: str = "", body: dict[str, Any] | None = None) -> Any:
        filename = (body or {}).get("filename")
        return serving().slot_action(id_slot, action, filename)

    @app.get("/metrics")
    async def metrics() -> Any:
        if not state.metrics_enabled:
            raise APIError(501, "This server does not support metrics endpoint. Start it with `--metrics`",
                           type="not_supported_error")
        return PlainTextResponse(serving().metrics_text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/loads")
    async def loads() -> Any:  # SGLang's load report, polled by gateways (smg): server/loads.py
        return engine_loads(serving().engine)

    # llama-server's routes for other kinds of model: the same 501 a client gets from it for a
    # model without that ability, not a bare 404.
    for paths, why in _NOT_SUPPORTED:
        for path in paths:
            app.add_api_route(path, _not_supported(why), methods=["POST"], include_in_schema=False)

    register_native_routes(app, serving, respond)
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


def sse_response(stream: AsyncIterator[str], ping_interval: float) -> StreamingResponse:
    return StreamingResponse(with_pings(stream, ping_interval), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
