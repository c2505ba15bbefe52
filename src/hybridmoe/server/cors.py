"""CORS as llama-server does it, with `--cors-origins` actually restricting.

Default (`*` with credentials): the request's Origin is echoed back and credentials allowed, so
browser front-ends on another port work. `localhost`: only origins whose host is localhost,
127.0.0.1 or ::1 are echoed. Otherwise a comma-separated list of exact origins. An origin not
allowed gets no `Access-Control-Allow-Origin`, so the browser blocks the response. Preflights
(`OPTIONS`) are answered here, before the API key check (browsers send no key on them), and any
other OPTIONS request with a 200 and `Allow` (llama-server answers every OPTIONS with a 200); with
`--cors-headers *` the headers the browser asks for are allowed by name, since browsers never let
`*` cover `Authorization`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass(frozen=True)
class CorsConfig:
    origins: str = "*"  # "*", "localhost", or comma-separated origins
    methods: str = "GET, POST, DELETE, OPTIONS"
    headers: str = "*"
    credentials: bool = True

    def allowed(self, origin: str) -> str | None:
        """The Access-Control-Allow-Origin value for this Origin, or None (not allowed)."""
        if self.origins == "*":
            return origin if self.credentials else "*"
        if self.origins == "localhost":
            try:
                host = urlsplit(origin).hostname
            except ValueError:
                return None
            return origin if host in LOCAL_HOSTS else None
        allowed = {o.strip().rstrip("/") for o in self.origins.split(",") if o.strip()}
        return origin if origin.rstrip("/") in allowed else None


class CorsMiddleware:
    """Plain ASGI (passes `receive` through, so handlers still see client disconnects)."""

    def __init__(self, app: Any, config: CorsConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        origin = headers.get("origin")
        allow = self.config.allowed(origin) if origin else None
        cors: list[tuple[bytes, bytes]] = []
        if allow is not None:
            cors.append((b"access-control-allow-origin", allow.encode("latin-1")))
            if self.config.credentials:
                cors.append((b"access-control-allow-credentials", b"true"))
            cors.append((b"vary", b"Origin"))
        if scope["method"] == "OPTIONS":  # as llama-server: every OPTIONS is a 200, CORS or not
            if allow is None:
                cors.append((b"allow", self.config.methods.encode("latin-1")))
            else:
                wanted = headers.get("access-control-request-headers", "")
                allow_headers = wanted if self.config.headers.strip() == "*" and wanted else self.config.headers
                cors += [(b"access-control-allow-methods", self.config.methods.encode("latin-1")),
                         (b"access-control-allow-headers", allow_headers.encode("latin-1")),
                         (b"access-control-max-age", b"600")]
            await send({"type": "http.response.start", "status": 200,
                        "headers": [*cors, (b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        if not cors:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        await self.app(scope, receive, send_with_cors)
