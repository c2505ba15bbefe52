"""Server test fixtures: one tiny synthetic model per session and real `hybridmoe serve` processes.

Servers listen on 127.0.0.1 at a free port; every wait is bounded; processes are stopped by pid.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

API_KEY = "dummy"
STARTUP_TIMEOUT_S = 90


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    base_url: str  # http://127.0.0.1:PORT
    api_key: str | None
    log_path: Path
    script_path: Path | None = None  # started through tests/server/scripted_serve.py
    tls: ssl.SSLContext | None = None  # an https server: the client context that trusts its certificate

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def script(self, *replies: str) -> None:
        """The next accepted requests' outputs, one harmony text per request, in order; none
        clears what is left."""
        from tests.server.scripted_serve import write_scripts

        assert self.script_path is not None, "this server was not started with scripted replies"
        write_scripts(self.script_path, list(replies))

    def request(self, method: str, path: str, body: object | bytes | None = None,
                headers: dict[str, str] | None = None, key: str | None = "default") -> tuple[int, dict | str]:
        """Plain HTTP (no client library): returns (status, parsed JSON or text)."""
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        key = self.api_key if key == "default" else key
        if key:
            hdrs["Authorization"] = f"Bearer {key}"
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method, headers=hdrs)
        try:
            with urllib.request.urlopen(req, timeout=60, context=self.tls) as r:
                status, raw = r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read().decode()
        try:
            return status, json.loads(raw)
        except json.JSONDecodeError:
            return status, raw


def start_server(model: str | None, args: list[str], log_path: Path, api_key: str | None,
                 script_path: Path | None = None, *, prefix: str = "", env: dict[str, str] | None = None,
                 tls: ssl.SSLContext | None = None) -> ServerProcess:
    """script_path: replies scripted from this file (`ServerProcess.script`), else plain
    `python -m hybridmoe.cli serve`. model None: no -m (the environment may name it). prefix: the
    server's --api-prefix, made part of base_url; env: variables added to the process's; tls: serve
    over https, trusted by this client context."""
    from tests.server.scripted_serve import launcher as scripted_launcher

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if script_path is not None:
        script_path.write_text("[]")
    launcher = scripted_launcher(script_path) if script_path else [sys.executable, "-m", "hybridmoe.cli"]
    cmd = [*launcher, "serve", *(["-m", model] if model else []), *args, "--port", str(port)]
    if "--host" not in args:
        cmd += ["--host", "127.0.0.1"]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    scheme = "https" if tls else "http"
    srv = ServerProcess(proc, f"{scheme}://127.0.0.1:{port}{prefix}", api_key, log_path, script_path, tls)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{srv.log()}")
        try:
            status, _ = srv.request("GET", "/health", key=None)
            if status == 200:
                return srv
        except (urllib.error.URLError, ConnectionError, TimeoutError, ssl.SSLError):
            pass
        time.sleep(0.2)
    stop_server(srv)
    raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{srv.log()}")


def stop_server(srv: ServerProcess) -> None:
    srv.proc.terminate()
    try:
        srv.proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        srv.proc.kill()
        srv.proc.wait(timeout=15)


@pytest.fixture(scope="session")
def served_model(tiny_gguf: str) -> str:
    """The suite's tiny random gpt-oss GGUF (tests/conftest.py), shared to save a synth per session."""
    return tiny_gguf


# The command line llama-server users run (README of issue 4), with --host 127.0.0.1 for tests.
LLAMA_LINE = ["--n-cpu-moe", "36", "--n-gpu-layers", "999", "-c", "0", "-fa", "--jinja",
              "--reasoning-format", "none", "--host", "127.0.0.1", "--api-key", API_KEY]


@pytest.fixture(scope="session")
def server(served_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server per session (startup dominates test time): the llama-server line plus metrics,
    an alias, small prompt batches (chunked prefill), a bounded queue and scripted replies.
    Tiny model: context 4096 split over 4 slots = 1024 tokens each."""
    logs = tmp_path_factory.mktemp("logs")
    extra = ["--metrics", "-np", "4", "-b", "64", "-a", "tiny-test", "--max-queue", "16", "-t", "1"]
    srv = start_server(served_model, LLAMA_LINE + extra, logs / "server.log", API_KEY, logs / "script.json")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def served_llm(tiny_llm):
    """The same file through the Python API (one thread, the model's 4096-token context)."""
    return tiny_llm


@pytest.fixture
def client(server: ServerProcess):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def scripted_server(served_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The tiny model behind `hybridmoe serve --api-key dummy -np 2`, replies scripted per request."""
    tmp = tmp_path_factory.mktemp("scripted")
    args = ["--api-key", API_KEY, "-np", "2", "-t", "1", "-a", "tiny-test"]
    srv = start_server(served_model, args, tmp / "server.log", API_KEY, tmp / "script.json")
    yield srv
    stop_server(srv)


# Servers whose scripts a test may leave unconsumed (a failure midway): cleared after each test.
SCRIPTED_FIXTURES = ("server", "scripted_server", "flagged")


@pytest.fixture(autouse=True)
def _clear_scripts(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    for name in SCRIPTED_FIXTURES:
        if name in request.fixturenames:
            request.getfixturevalue(name).script()
