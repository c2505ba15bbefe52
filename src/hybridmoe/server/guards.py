"""ASGI guards in front of the routes: the request body size limit, invalid Unicode in JSON
bodies, every body read as JSON whatever its Content-Type (as llama-server does), and HEAD
answered wherever GET is.

Plain ASGI (not `@app.middleware`) so `receive` reaches the handlers untouched after the body
is replayed: they still see a client disconnect at once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import anyio

from hybridmoe.server.protocol import APIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# A JSON body can only decode to a lone surrogate through a \uD800-\uDFFF escape or raw
# CESU-8 bytes (json.loads decodes bytes with surrogatepass); bodies without either skip the parse.
_SURROGATE_HINT = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_PARSE_OFF_LOOP_BYTES = 1 << 16
# A refused body is read and dropped (up to these bounds) before the 413 goes out: most clients
# send the whole body before reading the answer, and a connection closed under them reads as a
# reset, not as a 413. Past the bounds the connection is closed.
_DRAIN_MAX_BYTES = 256 << 20
_DRAIN_MAX_SECONDS = 5.0


async def _answer(err: APIError, send: Send) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _too_large(limit: int, size: int | None) -> APIError:
    got = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    return APIError(413, f"request body is {got}, more than the server's limit of {limit} bytes "
                         f"(serve --max-body-size)", code="request_too_large")


class BodyGuard:
    """Bodies of POST/PUT/PATCH requests: 413 above `max_bytes` (from Content-Length before
    reading anything, else while reading), 400 naming the field for a string holding a lone
    UTF-16 surrogate (the tokenizer and JSON encoders reject those deep inside). A non-empty
    body goes on as JSON whatever its Content-Type: `curl -d '{...}'` sends form encoding, and
    llama-server parses it all the same (a body that is not JSON still gets the route's 400)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            if not _expects_continue(scope):  # else the client waits for our answer before sending
                await _drain(receive)
            await _answer(_too_large(self.max_bytes, declared), send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                del chunks
                if message.get("more_body", False):
                    await _drain(receive)
                await _answer(_too_large(self.max_bytes, None), send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        del chunks
        if _SURROGATE_HINT.search(body):
            found = await _find_surrogate(body)
            if found is not None:
                await _answer(found, send)
                return
        await self.app(_as_json(scope) if body else scope, _replay(body, receive), send)


def _as_json(scope: Scope) -> Scope:
    ctype = _header(scope, b"content-type")
    if ctype is not None and b"json" in ctype.lower():
        return scope
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}


def _header(scope: Scope, wanted: bytes) -> bytes | None:
    for name, value in scope["headers"]:
        if name.lower() == wanted:
            return value
    return None


def _content_length(scope: Scope) -> int | None:
    value = _header(scope, b"content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _expects_continue(scope: Scope) -> bool:
    return (_header(scope, b"expect") or b"").lower() == b"100-continue"


async def _drain(receive: Receive) -> None:
    """Read and drop the rest of a refused body, within _DRAIN_MAX_BYTES / _DRAIN_MAX_SECONDS."""
    dropped = 0
    with anyio.move_on_after(_DRAIN_MAX_SECONDS):
        while dropped <= _DRAIN_MAX_BYTES:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            dropped += len(message.get("body", b""))


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # afterwards: the real channel (disconnects)

    return replayed


async def _find_surrogate(body: bytes) -> APIError | None:
    if len(body) > _PARSE_OFF_LOOP_BYTES:
        return await anyio.to_thread.run_sync(surrogate_error, body)
    return surrogate_error(body)


def surrogate_error(body: bytes) -> APIError | None:
    """A 400 naming the first string (or key) of a JSON body with a lone surrogate, else None
    (also for a body that is not JSON: the route reports that)."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[Any, tuple[str, ...]]] = [(value, ())]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            hit = _SURROGATE.search(v)
            if hit:
                return _surrogate_400(path, f"U+{ord(hit.group()):04X} at character {hit.start()}")
        elif isinstance(v, dict):
            for k, x in v.items():
                if _SURROGATE.search(k):
                    return _surrogate_400(path, f"in the key {k.encode('utf-8', 'backslashreplace').decode()!r}")
                stack.append((x, path + (k,)))
        elif isinstance(v, list):
            stack.extend((x, path + (str(i),)) for i, x in enumerate(v))
    return None


def _surrogate_400(path: tuple[str, ...], where: str) -> APIError:
    param = ".".join(path) or None
    msg = f"a lone UTF-16 surrogate ({where}) is not valid Unicode text"
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_unicode")


class HeadAsGet:
    """HEAD is served by the GET route with the body dropped (load balancers probe /health with
    HEAD); the headers, Content-Length included, are GET's."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)
