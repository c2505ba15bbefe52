"""Claude Code, the real client, against `hybridmoe serve` on the bundled demo model.

Nothing is installed here: the test runs when `claude` is found, under $HYBRIDMOE_NODE_PREFIX
(`npm install --prefix DIR @anthropic-ai/claude-code`: DIR/node_modules/.bin/claude; .ci/run does
this) or on PATH, and skips saying so otherwise. Claude Code talks to the server through a
recording proxy (ANTHROPIC_BASE_URL), so the tests see what it sent; it runs offline, with a key
from the environment and a fresh HOME (no login, no telemetry, no update check). The first test is
a user's first run (the demo model writes what it writes); the scripted ones fix the model's reply,
so what Claude Code prints and does with our text and tool_use blocks is checked.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.server.agent_clients import DEMO, demo_fixtures
from tests.server.conftest import ServerProcess
from tests.server.recording_proxy import RecordingProxy

API_KEY = "claude-code-test"
MODEL = "gpt-oss-120b"  # a name Claude Code does not know: it assumes a 1M window and says so on stderr
RUN_TIMEOUT_S = 240
# What keeps a run off the network (docs: Claude Code's environment variables).
OFFLINE = {"DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}


def _claude() -> str | None:
    """The `claude` binary, if it runs (npm leaves a stub in its place when the package's
    install script, which puts the native binary there, did not run)."""
    prefix = os.environ.get("HYBRIDMOE_NODE_PREFIX")
    found = Path(prefix) / "node_modules" / ".bin" / "claude" if prefix else None
    path = str(found) if found is not None and found.exists() else shutil.which("claude")
    if path is None:
        return None
    try:
        ok = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60,
                            stdin=subprocess.DEVNULL).stdout.strip().endswith("(Claude Code)")
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return path if ok else None


CLAUDE = _claude()
pytestmark = [
    pytest.mark.skipif(CLAUDE is None, reason="Claude Code not found: set HYBRIDMOE_NODE_PREFIX to an `npm install "
                       "--prefix DIR @anthropic-ai/claude-code` folder, or put `claude` on PATH"),
    pytest.mark.skipif(not DEMO.exists(), reason="demo.gguf not built yet (see demo/README.md)"),
]


def run_claude(tmp_path: Path, base_url: str, prompt: str, *extra: str) -> subprocess.CompletedProcess:
    """`claude -p` in a fresh folder with a fresh HOME, as docs/server.md tells users to point it
    at a local server."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home), "ANTHROPIC_BASE_URL": base_url,
           "ANTHROPIC_API_KEY": API_KEY, "NO_COLOR": "1", **OFFLINE}
    return subprocess.run([CLAUDE, "-p", prompt, "--model", MODEL, *extra], cwd=work, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def _explain(result: subprocess.CompletedProcess, srv: ServerProcess) -> str:
    return f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}\n" \
           f"server log:\n{srv.log()[-3000:]}"


def messages(proxy: RecordingProxy) -> list[dict]:
    """The bodies of Claude Code's /v1/messages requests (it adds `?beta=true`)."""
    return [b for m, p, b in proxy.requests
            if m == "POST" and p.split("?")[0] == "/v1/messages" and isinstance(b, dict)]


def check_count_tokens(proxy: RecordingProxy, srv: ServerProcess) -> None:
    """Claude Code's count_tokens calls, if it made any, answered with a count when sent again."""
    for m, p, body in proxy.requests:
        if m == "POST" and p.split("?")[0] == "/v1/messages/count_tokens":
            status, out = srv.request("POST", p, body, headers={"x-api-key": API_KEY}, key=None)
            assert status == 200 and out["input_tokens"] > 0, out


demo_server, scripted_demo, _clear_script = demo_fixtures(API_KEY, "claude")


def test_claude_p_runs_against_the_demo_model(demo_server, tmp_path):
    """A new user's first run ends with exit 0, after streamed requests carrying what Claude Code
    sends (cached system blocks, its tools, adaptive thinking)."""
    with RecordingProxy(demo_server.base_url) as proxy:
        result = run_claude(tmp_path, proxy.url, "Say hello.")
    assert result.returncode == 0, _explain(result, demo_server)
    sent = messages(proxy)
    assert sent, proxy.requests
    last = sent[-1]
    assert last["model"] == MODEL and last["stream"] is True and last["max_tokens"] > 0
    assert any(isinstance(b, dict) and b.get("cache_control") for b in last["system"]), last["system"]
    assert {"Bash", "Read", "Write"} <= {t["name"] for t in last["tools"]}
    assert "Say hello." in json.dumps(last["messages"])
    check_count_tokens(proxy, demo_server)


def test_scripted_answer_is_what_claude_prints(scripted_demo, tmp_path):
    """Our SSE (thinking, then text) is read as Claude Code reads Anthropic's: the text is its output."""
    scripted_demo.script("<|channel|>analysis<|message|>The user greets me.<|end|><|start|>assistant"
                         "<|channel|>final<|message|>Hello from the demo model!<|return|>")
    with RecordingProxy(scripted_demo.base_url) as proxy:
        result = run_claude(tmp_path, proxy.url, "Say hello.")
    assert result.returncode == 0, _explain(result, scripted_demo)
    assert result.stdout.strip() == "Hello from the demo model!", _explain(result, scripted_demo)
    check_count_tokens(proxy, scripted_demo)


def test_tool_use_runs_and_its_result_comes_back(scripted_demo, tmp_path):
    """A tool_use block from us is run by Claude Code (Write, allowed on the command line) and its
    tool_result comes back in the next request with the same id."""
    target = tmp_path / "work" / "hello.txt"
    call = json.dumps({"file_path": str(target), "content": "Hello from the demo model\n"})
    scripted_demo.script(
        "<|channel|>analysis<|message|>I will write the file.<|end|><|start|>assistant<|channel|>commentary "
        f"to=functions.Write <|constrain|>json<|message|>{call}<|call|>",
        "<|channel|>final<|message|>Wrote hello.txt.<|return|>")
    with RecordingProxy(scripted_demo.base_url) as proxy:
        result = run_claude(tmp_path, proxy.url, "Create hello.txt", "--allowedTools", "Write")
    assert result.returncode == 0, _explain(result, scripted_demo)
    assert target.read_text() == "Hello from the demo model\n"
    assert result.stdout.strip() == "Wrote hello.txt.", _explain(result, scripted_demo)
    history = messages(proxy)[-1]["messages"]
    use = next(b for m in history if m["role"] == "assistant" and isinstance(m["content"], list)
               for b in m["content"] if b["type"] == "tool_use")
    assert use["name"] == "Write" and use["input"] == json.loads(call)
    results = [b for m in history if m["role"] == "user" and isinstance(m["content"], list)
               for b in m["content"] if b["type"] == "tool_result"]
    assert [r["tool_use_id"] for r in results] == [use["id"]] and not results[0].get("is_error"), results


def test_every_request_claude_code_sends_is_accepted(scripted_demo, tmp_path):
    """Each /v1/messages body Claude Code sent, sent again to count_tokens (which validates the
    same request without generating), is accepted: among them the ones with its environment as a
    role "system" message inside `messages`."""
    scripted_demo.script("<|channel|>final<|message|>Hello!<|return|>")
    with RecordingProxy(scripted_demo.base_url) as proxy:
        result = run_claude(tmp_path, proxy.url, "Say hello.")
    assert result.returncode == 0, _explain(result, scripted_demo)
    sent = messages(proxy)
    assert any(m["role"] == "system" for body in sent for m in body["messages"]), sent
    for body in sent:
        status, out = scripted_demo.request("POST", "/v1/messages/count_tokens", body,
                                            headers={"x-api-key": API_KEY}, key=None)
        assert status == 200, (out, [m["role"] for m in body["messages"]])


def test_malformed_harmony_reaches_claude_code_as_text(scripted_demo, tmp_path):
    scripted_demo.script("<|channel|>anon-ECh, in the same example, 0.5.<|return|>")
    with RecordingProxy(scripted_demo.base_url) as proxy:
        result = run_claude(tmp_path, proxy.url, "Say hello.")
    assert result.returncode == 0, _explain(result, scripted_demo)
    assert "in the same example" in result.stdout, _explain(result, scripted_demo)
    assert "no visible output" not in json.dumps(messages(proxy)[-1]["messages"])
