"""What the real-client tests (Codex CLI, Claude Code) share: the bundled demo model served as a
user starts it, plainly and with replies scripted per request (tests/server/scripted_serve.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.server.conftest import ServerProcess, start_server, stop_server

DEMO = Path(__file__).resolve().parents[2] / "src" / "hybridmoe" / "data" / "demo.gguf"


def serve_args(api_key: str) -> list[str]:
    """One slot with room for a client's first request (Codex ~11k demo-model tokens of
    instructions and tool schemas, Claude Code ~16k of system blocks and tools)."""
    return ["--api-key", api_key, "-t", "1", "-np", "1", "-c", "32768"]


def demo_fixtures(api_key: str, label: str) -> tuple[Callable, Callable, Callable]:
    """A test module's `demo_server` and `scripted_demo` fixtures (module scope) and the autouse
    fixture that drops a failed scripted test's leftover replies; bind them to those names."""

    @pytest.fixture(scope="module", name="demo_server")
    def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
        srv = start_server(str(DEMO), serve_args(api_key), tmp_path_factory.mktemp(f"{label}-demo") / "server.log",
                           api_key)
        yield srv
        stop_server(srv)

    @pytest.fixture(scope="module", name="scripted_demo")
    def scripted_demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
        tmp = tmp_path_factory.mktemp(f"{label}-scripted")
        srv = start_server(str(DEMO), serve_args(api_key), tmp / "server.log", api_key, tmp / "script.json")
        yield srv
        stop_server(srv)

    @pytest.fixture(autouse=True, name="_clear_script")
    def clear_script(request: pytest.FixtureRequest) -> Iterator[None]:
        yield
        if "scripted_demo" in request.fixturenames:
            request.getfixturevalue("scripted_demo").script()

    return demo_server, scripted_demo, clear_script
