"""A pass-through HTTP proxy that keeps every request body: what a real client (Codex CLI) sent,
for tests to inspect, while the server under test answers it (streams relayed as they come)."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.error
import urllib.request
from typing import Any

_HOP = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}


class RecordingProxy:
    """`RecordingProxy(upstream)`: listens on 127.0.0.1 at `url`; `requests` holds (method, path,
    parsed JSON body or None) in arrival order. Use as a context manager."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.requests: list[tuple[str, str, Any]] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # the test's output stays quiet
                pass

            def _relay(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    parsed = json.loads(body) if body else None
                except ValueError:
                    parsed = None
                proxy.requests.append((self.command, self.path, parsed))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                req = urllib.request.Request(proxy.upstream + self.path, data=body or None, method=self.command,
                                             headers=headers)
                try:
                    resp = urllib.request.urlopen(req, timeout=300)
                except urllib.error.HTTPError as e:
                    resp = e
                self.send_response(resp.status if hasattr(resp, "status") else resp.code)
                for k, v in resp.headers.items():
                    if k.lower() not in _HOP:
                        self.send_header(k, v)
                self.send_header("Connection", "close")
                self.end_headers()
                read = getattr(resp, "read1", resp.read)  # an HTTPError has no read1
                while chunk := read(65536):
                    self.wfile.write(chunk)
                    self.wfile.flush()

            do_GET = do_POST = do_HEAD = _relay

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def bodies(self, path_suffix: str = "/responses") -> list[dict[str, Any]]:
        """The JSON bodies of the POSTs whose path ends with `path_suffix`."""
        return [b for m, p, b in self.requests if m == "POST" and p.endswith(path_suffix) and isinstance(b, dict)]
