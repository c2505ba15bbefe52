"""The bundled chat page (`server/webui/`) at `GET /`.

The page and its scripts are public, as llama-server's UI is: they hold no model or server data,
and the page asks for the API key itself and sends it with every API call. The headers forbid the
page any script, style or connection other than this server's own files and API.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

WEBUI_DIR = Path(__file__).with_name("webui")
_ASSET_TYPES = {
    "app.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
PAGE_PATHS = ("/", "/index.html")
# Open without the API key: exactly the page and its assets, nothing else.
WEBUI_PUBLIC_PATHS = frozenset(PAGE_PATHS) | {f"/webui/{name}" for name in _ASSET_TYPES}

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # a server upgrade shows its new page at once
}


def add_webui_routes(app: FastAPI) -> None:
    """Serves the page and its assets from memory (read once: a few tens of KiB)."""
    page = (WEBUI_DIR / "index.html").read_bytes()
    assets = {name: (WEBUI_DIR / name).read_bytes() for name in _ASSET_TYPES}

    async def index() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)

    for path in PAGE_PATHS:
        app.add_api_route(path, index, methods=["GET"], include_in_schema=False)

    def asset_route(name: str) -> None:
        async def asset() -> Response:
            return Response(assets[name], media_type=_ASSET_TYPES[name], headers=SECURITY_HEADERS)

        app.add_api_route(f"/webui/{name}", asset, methods=["GET"], include_in_schema=False)

    for name in _ASSET_TYPES:
        asset_route(name)
