"""The bundled demo model behind `hybridmoe serve`, no seams: it really calls the demo tool and
really reasons in the analysis channel (fixed seeds, default sampling, the openai client).

The demo model was trained for exactly these formats (demo/corpus.py); the seamed tests elsewhere
check the parsing of every shape, these check that a user trying the bundled model sees them work.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.conftest import ServerProcess, start_server, stop_server

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "src" / "hybridmoe" / "data" / "demo.gguf"
API_KEY = "demo-live"

pytestmark = pytest.mark.skipif(not DEMO.exists(), reason="demo.gguf not built yet (see demo/README.md)")


def _lookup_verse_module():
    """demo/lookup_verse.py: the tool's declaration and implementation, as a user runs them."""
    spec = importlib.util.spec_from_file_location("demo_lookup_verse", ROOT / "demo" / "lookup_verse.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("demo-live") / "server.log"
    srv = start_server(str(DEMO), ["--api-key", API_KEY, "-t", "1", "--reasoning-format", "auto"], log, API_KEY)
    yield srv
    stop_server(srv)


@pytest.fixture
def demo_client(demo_server: ServerProcess):
    from openai import OpenAI

    return OpenAI(base_url=demo_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_demo_model_calls_the_verse_tool_and_quotes_the_result(demo_client):
    lv = _lookup_verse_module()
    messages = [{"role": "user", "content": "What does John 3:16 say?"}]
    first = demo_client.chat.completions.create(model="demo", messages=messages, tools=[lv.LOOKUP_VERSE_TOOL],
                                                seed=0, max_tokens=200)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "lookup_verse"
    args = json.loads(call.function.arguments)
    assert args == {"book": "John", "chapter": 3, "verse": 16}, args  # v3 copies the asked reference
    result = lv.lookup_verse(**args)
    assert not result.startswith("Error"), (args, result)  # an existing verse
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": result}]
    final = demo_client.chat.completions.create(model="demo", messages=messages, tools=[lv.LOOKUP_VERSE_TOOL],
                                                seed=0, max_tokens=200)
    assert final.choices[0].finish_reason == "stop"
    assert result in final.choices[0].message.content  # and quotes the tool's text


def test_demo_model_reasons_in_the_analysis_channel(demo_client):
    r = demo_client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "What is wisdom?"}],
                                            reasoning_effort="high", seed=0, max_tokens=200)
    msg = r.choices[0].message
    reasoning = getattr(msg, "reasoning_content", None) or (msg.model_extra or {}).get("reasoning_content")
    assert reasoning and reasoning.strip(), msg
    assert msg.content and msg.content.strip(), msg
    assert r.choices[0].finish_reason == "stop"
    assert "<|" not in reasoning + msg.content  # harmony markup parsed away, not leaked


def test_tool_call_arguments_follow_the_declared_schema(demo_client):
    """tool_choice auto: the model writes a call freely, but once it calls a declared function its
    arguments are held to that function's `parameters` (llama-server's lazy tool-call grammar).
    Declared with another schema than the one it was trained on, the demo tool still gets a call
    whose arguments fit: unconstrained, the model writes book / chapter / verse."""
    tool = {"type": "function", "function": {
        "name": "lookup_verse", "description": "Look up a verse by its number",
        "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}
    messages = [{"role": "user", "content": "Look up verse 3 please"}]
    r = demo_client.chat.completions.create(model="demo", messages=messages, tools=[tool], temperature=0, max_tokens=120)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    args = json.loads(choice.message.tool_calls[0].function.arguments)
    assert set(args) == {"n"} and isinstance(args["n"], int), args
