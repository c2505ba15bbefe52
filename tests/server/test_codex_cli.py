"""Codex CLI, the real client, against `hybridmoe serve` on the bundled demo model.

Nothing is installed here: the test runs when `codex` is found, under $HYBRIDMOE_NODE_PREFIX
(`npm install --prefix DIR @openai/codex`: DIR/node_modules/.bin/codex; .ci/run does this) or on
PATH, and skips saying so otherwise. Codex talks to the server through a recording proxy, so the
tests see what it sent. The first test is a user's first run (the demo model writes what it
writes); the scripted ones make the model call apply_patch and a namespace tool's function, so
Codex's own handling of our items (patch applied, call routed) and its resent history are checked.
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

API_KEY = "codex-test"
RUN_TIMEOUT_S = 240


def _codex() -> str | None:
    prefix = os.environ.get("HYBRIDMOE_NODE_PREFIX")
    if prefix:
        found = Path(prefix) / "node_modules" / ".bin" / "codex"
        if found.exists():
            return str(found)
    return shutil.which("codex")


CODEX = _codex()
pytestmark = [
    pytest.mark.skipif(CODEX is None, reason="Codex CLI not found: set HYBRIDMOE_NODE_PREFIX to an "
                       "`npm install --prefix DIR @openai/codex` folder, or put `codex` on PATH"),
    pytest.mark.skipif(not DEMO.exists(), reason="demo.gguf not built yet (see demo/README.md)"),
]


def _config(base_url: str, model: str) -> str:
    """A local provider as docs/server.md tells users to configure it (plus no retries, no
    update check, no analytics: a test has no network)."""
    return f"""model = "{model}"
model_provider = "hybridmoe"
check_for_update_on_startup = false

[analytics]
enabled = false

[model_providers.hybridmoe]
name = "hybridmoe"
base_url = "{base_url}/v1"
wire_api = "responses"
env_key = "HYBRIDMOE_API_KEY"
request_max_retries = 0
stream_max_retries = 0
"""


def run_codex(tmp_path: Path, base_url: str, model: str, prompt: str, *extra: str) -> subprocess.CompletedProcess:
    """`codex exec` in a fresh folder with its own CODEX_HOME (no login: the key comes from the
    provider's env_key)."""
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(_config(base_url, model))
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "CODEX_HOME": str(home),
           "HYBRIDMOE_API_KEY": API_KEY, "NO_COLOR": "1"}
    return subprocess.run([CODEX, "exec", "--skip-git-repo-check", *extra, prompt], cwd=work, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def _explain(result: subprocess.CompletedProcess, srv: ServerProcess) -> str:
    return f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}\n" \
           f"server log:\n{srv.log()[-3000:]}"


def catalog_model(tmp_path: Path, code_mode: bool) -> str | None:
    """A model of this Codex version's own catalog (`codex debug models`) with the freeform
    apply_patch tool: one that gets it as a `custom` tool, or (code_mode) one whose tools come in
    an `additional_tools` input item around the freeform `exec` tool; None if there is none."""
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "CODEX_HOME": str(tmp_path)}
    out = subprocess.run([CODEX, "debug", "models"], env=env, stdin=subprocess.DEVNULL, capture_output=True,
                         text=True, timeout=60)
    try:
        models = json.loads(out.stdout)["models"]
    except (ValueError, KeyError, TypeError):
        return None
    return next((m["slug"] for m in models if m.get("apply_patch_tool_type") == "freeform"
                 and str(m.get("tool_mode") or "").startswith("code_mode") == code_mode), None)


def declared(body: dict) -> list[dict]:
    """Every tool a request declares: `tools`, and those of its `additional_tools` items."""
    items = [i for i in body["input"] if i.get("type") == "additional_tools"]
    return [*body.get("tools", []), *(t for i in items for t in i.get("tools", []))]


def inner(tools: list[dict]) -> list[dict]:
    """The tools, with those of namespaces in place of the namespaces."""
    return [u for t in tools for u in (t.get("tools", []) if t["type"] == "namespace" else [t])]


demo_server, scripted_demo, _clear_script = demo_fixtures(API_KEY, "codex")


@pytest.mark.parametrize("kind", ["unknown-model", "freeform-model", "code-mode-model"])
def test_codex_exec_runs_against_the_demo_model(demo_server, tmp_path, kind):
    """A new user's first run ends with exit 0, and our server got Codex's tools: namespace and
    hosted ones for a model Codex does not know, the freeform apply_patch for one of its own, and
    tools inside the input (`additional_tools`) for its code-mode models."""
    model = "gpt-oss-120b" if kind == "unknown-model" else catalog_model(tmp_path, kind == "code-mode-model")
    if model is None:
        pytest.skip(f"this Codex version's catalog has no {kind}")
    with RecordingProxy(demo_server.base_url) as proxy:
        result = run_codex(tmp_path, proxy.url, model, "Say hello.")
    assert result.returncode == 0, _explain(result, demo_server)
    first = proxy.bodies()[0]
    assert first["model"] == model and first["store"] is False
    tools = declared(first)
    assert any(t["type"] == "function" for t in inner(tools)), tools
    if kind == "freeform-model":
        assert any(t["type"] == "custom" and t["name"] == "apply_patch" for t in tools), tools
    if kind == "code-mode-model":
        assert any(t["type"] == "custom" and t["name"] == "exec" for t in inner(tools)), tools


def test_apply_patch_comes_back_as_a_custom_tool_call_codex_applies(scripted_demo, tmp_path):
    model = catalog_model(tmp_path, code_mode=False)
    if model is None:
        pytest.skip("this Codex version's catalog has no model with the freeform apply_patch tool")
    patch = "*** Begin Patch\n*** Add File: hello.txt\n+Hello from the demo model\n*** End Patch\n"
    scripted_demo.script(
        "<|channel|>analysis<|message|>I will write the file.<|end|><|start|>assistant<|channel|>commentary "
        f"to=functions.apply_patch <|constrain|>json<|message|>{json.dumps({'input': patch})}<|call|>",
        "<|channel|>final<|message|>Wrote hello.txt.<|return|>")
    with RecordingProxy(scripted_demo.base_url) as proxy:
        result = run_codex(tmp_path, proxy.url, model, "Create hello.txt", "-s", "workspace-write")
    assert result.returncode == 0, _explain(result, scripted_demo)
    assert (tmp_path / "work" / "hello.txt").read_text() == "Hello from the demo model\n"
    second = proxy.bodies()[1]["input"]  # store: false, so Codex resends the turn it got
    reasoning = next(i for i in second if i["type"] == "reasoning")
    assert reasoning["encrypted_content"] and reasoning["content"][0]["text"] == "I will write the file."
    call = next(i for i in second if i["type"] == "custom_tool_call")
    assert call["name"] == "apply_patch" and call["input"] == patch
    output = next(i for i in second if i["type"] == "custom_tool_call_output")
    assert output["call_id"] == call["call_id"]


def test_a_namespace_function_call_reaches_codexs_handler(scripted_demo, tmp_path):
    """Codex routes a call by namespace and name: a call to multi_agent_v1's close_agent reaches
    its handler (which refuses the made-up agent id) instead of 'unsupported call'."""
    scripted_demo.script(
        "<|channel|>commentary to=functions.multi_agent_v1__close_agent <|constrain|>json<|message|>"
        '{"target": "nobody"}<|call|>',
        "<|channel|>final<|message|>Done.<|return|>")
    with RecordingProxy(scripted_demo.base_url) as proxy:
        result = run_codex(tmp_path, proxy.url, "gpt-oss-120b", "Close the agent called nobody.")
    assert result.returncode == 0, _explain(result, scripted_demo)
    first, second = proxy.bodies()[:2]
    namespaces = [t for t in first["tools"] if t["type"] == "namespace"]
    if not any(t["name"] == "multi_agent_v1" for t in namespaces):
        pytest.skip(f"this Codex version sends no multi_agent_v1 namespace ({[t['name'] for t in namespaces]})")
    call = next(i for i in second["input"] if i["type"] == "function_call")
    assert (call["namespace"], call["name"]) == ("multi_agent_v1", "close_agent")
    output = next(i for i in second["input"] if i["type"] == "function_call_output")
    assert "unsupported call" not in json.dumps(output["output"]), output


def test_code_mode_exec_in_additional_tools_runs(scripted_demo, tmp_path):
    """Codex's code-mode models declare `exec` (freeform JavaScript) in the `functions` namespace
    of an `additional_tools` input item: the call comes back as a custom_tool_call Codex runs."""
    model = catalog_model(tmp_path, code_mode=True)
    if model is None:
        pytest.skip("this Codex version's catalog has no code-mode model")
    scripted_demo.script(
        "<|channel|>commentary to=functions.exec <|constrain|>json<|message|>"
        f"{json.dumps({'input': 'text(6 * 7)'})}<|call|>",
        "<|channel|>final<|message|>It is 42.<|return|>")
    with RecordingProxy(scripted_demo.base_url) as proxy:
        result = run_codex(tmp_path, proxy.url, model, "Compute 6 * 7 with exec.")
    assert result.returncode == 0, _explain(result, scripted_demo)
    second = proxy.bodies()[1]["input"]
    call = next(i for i in second if i["type"] == "custom_tool_call")
    assert call["name"] == "exec" and call["input"] == "text(6 * 7)"
    output = next(i for i in second if i["type"] == "custom_tool_call_output")
    assert "42" in json.dumps(output["output"]), output
