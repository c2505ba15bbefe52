"""The bundled demo.gguf in a real llama.cpp `llama-server --jinja`: it loads, chats, and renders
the same prompts as this project's template renderer.

Needs a llama-server binary (build llama.cpp, then point HYBRIDMOE_LLAMA_SERVER at
build/bin/llama-server); skipped without one, since CI machines do not build llama.cpp.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridmoe.gguf.reader import GGUFFile
from hybridmoe.tokenizer.chat_template import render_chat

from .server.conftest import free_port

LLAMA_SERVER = os.environ.get("HYBRIDMOE_LLAMA_SERVER", "")
DEMO = Path(__file__).resolve().parent.parent / "src" / "hybridmoe" / "data" / "demo.gguf"

pytestmark = [
    pytest.mark.skipif(not (LLAMA_SERVER and Path(LLAMA_SERVER).is_file()),
                       reason="no llama-server binary: set HYBRIDMOE_LLAMA_SERVER to build/bin/llama-server"),
    pytest.mark.skipif(not DEMO.exists(), reason="demo.gguf not built yet (see demo/README.md)"),
]

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "description": "City name"},
                                               "unit": {"type": "string", "enum": ["c", "f"]}},
                                               "required": ["city"]}}}]
CONVERSATIONS = [
    ("plain", [{"role": "user", "content": "Who was David?"}], None),
    ("system", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], None),
    ("tools", [{"role": "user", "content": "Weather in Paris?"}], TOOLS),
    ("tool history", [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], TOOLS),
    ("finished turns", [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"}], None),
]


def _post(port: int, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@contextlib.contextmanager
def llama_server(log_dir: Path, *flags: str) -> Iterator[int]:
    """llama-server on the demo model with these flags: its port while the block runs."""
    port = free_port()
    log = open(log_dir / "llama-server.log", "wb")
    proc = subprocess.Popen([LLAMA_SERVER, "-m", str(DEMO), *flags, "--host", "127.0.0.1", "--port", str(port),
                             "-c", "2048", "-np", "1", "-t", "1", "--no-warmup"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"llama-server exited {proc.returncode}: {Path(log.name).read_text()[-2000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.3)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    with llama_server(tmp_path_factory.mktemp("llama"), "--jinja") as port:
        yield port


def test_demo_model_chats_in_llama_server(llama):
    """llama-server runs the demo model; 40 tokens may all go to reasoning, which it returns apart."""
    status, r = _post(llama, "/v1/chat/completions", {"messages": CONVERSATIONS[0][1], "max_tokens": 40, "seed": 1})
    msg = r["choices"][0]["message"]
    assert status == 200 and (msg.get("content") or msg.get("reasoning_content")), r


@pytest.mark.parametrize("name,messages,tools", CONVERSATIONS, ids=[c[0] for c in CONVERSATIONS])
def test_llama_server_renders_the_same_prompt(llama, name, messages, tools):
    body = {"messages": messages, **({"tools": tools} if tools else {})}
    status, r = _post(llama, "/apply-template", body)
    assert status == 200, r
    template = GGUFFile(DEMO).metadata["tokenizer.chat_template"]
    # llama.cpp copies reasoning_content to the gpt-oss template's `thinking` field, as the server does here.
    msgs = [{**m, **({"thinking": m["reasoning_content"]} if "reasoning_content" in m else {})} for m in messages]
    ours = render_chat(template, msgs, tools=tools, add_generation_prompt=True)
    assert r["prompt"] == ours
