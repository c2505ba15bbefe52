"""Multi-turn chats through a real server on the demo model (-c 4096 -np 1): every turn resends the
conversation, and the server must serve the previous turn's whole prompt from cache, also when
two conversations take turns on the one slot (the RAM prompt cache), and with streaming."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from tests.server.conftest import start_server, stop_server

DEMO = Path(__file__).resolve().parents[2] / "src" / "hybridmoe" / "data" / "demo.gguf"
pytestmark = pytest.mark.skipif(not DEMO.exists(), reason="demo.gguf not built (see demo/README.md)")

FIRST = ("The book of Psalms is a collection of songs and prayers. " * 45).strip()  # ~500 tokens
FOLLOW_UPS = ["Tell me more.", "Why is that?", "And what comes next?"]


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    srv = start_server(str(DEMO), ["-c", "4096", "-np", "1", "-t", "1", "--metrics", "--slot-save-path",
                                   str(tmp_path_factory.mktemp("slots"))],
                       tmp_path_factory.mktemp("logs") / "demo.log", None)
    yield srv
    stop_server(srv)


def chat(srv, messages: list[dict], stream: bool = False) -> tuple[str, dict, dict]:
    body = {"messages": messages, "max_tokens": 150, "temperature": 0, "seed": 1}
    if not stream:
        status, r = srv.request("POST", "/v1/chat/completions", body)
        assert status == 200, r
        return r["choices"][0]["message"]["content"] or "", r["usage"], r["timings"]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(srv.base_url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    text, usage, timings = [], None, None
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            c = json.loads(line[6:])
            usage = c.get("usage") or usage
            timings = c.get("timings") or timings
            for ch in c["choices"]:
                text.append(ch["delta"].get("content") or "")
    return "".join(text), usage, timings


def converse(srv, messages: list[dict], stream: bool = False) -> tuple[int, int, int]:
    """One turn: (prompt tokens, cached tokens, timings.cache_n); appends the reply."""
    reply, usage, timings = chat(srv, messages, stream)
    messages.append({"role": "assistant", "content": reply})
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], timings["cache_n"]


@pytest.mark.parametrize("stream", [False, True])
def test_each_turn_reuses_the_previous_prompt(demo_server, stream):
    msgs = [{"role": "user", "content": FIRST + (" (streamed)" if stream else "")}]
    prev, _, _ = converse(demo_server, msgs, stream)
    assert prev > 450
    for text in FOLLOW_UPS:
        msgs.append({"role": "user", "content": text})
        n, cached, cache_n = converse(demo_server, msgs, stream)
        assert cached == cache_n
        assert cached >= prev - 1, (n, cached, prev)
        prev = n


def test_two_conversations_on_one_slot(demo_server):
    a = [{"role": "user", "content": FIRST}]
    b = [{"role": "user", "content": "Who wrote the book of Job? " + FIRST[:600]}]
    prev = {"a": converse(demo_server, a)[0], "b": converse(demo_server, b)[0]}
    for text in FOLLOW_UPS[:2]:
        for name, msgs in (("a", a), ("b", b)):
            msgs.append({"role": "user", "content": text})
            n, cached, _ = converse(demo_server, msgs)
            assert cached >= prev[name] - 1, (name, n, cached, prev[name])
            prev[name] = n
    status, metrics = demo_server.request("GET", "/metrics")
    assert status == 200 and "hybridmoe:prompt_cache_bytes" in metrics
    cache_bytes = float(re.search(r"^hybridmoe:prompt_cache_bytes (\S+)$", metrics, re.M).group(1))
    assert cache_bytes > 0


def test_slot_save_restore_erase(demo_server):
    msgs = [{"role": "user", "content": FIRST + " Saved."}]
    prev, _, _ = converse(demo_server, msgs)
    status, saved = demo_server.request("POST", "/slots/0?action=save", {"filename": "conv.bin"})
    assert status == 200 and saved["n_saved"] >= prev and saved["n_written"] > 0, saved
    status, erased = demo_server.request("POST", "/slots/0?action=erase")
    assert status == 200 and erased["n_erased"] == saved["n_saved"]
    status, restored = demo_server.request("POST", "/slots/0?action=restore", {"filename": "conv.bin"})
    assert status == 200 and restored["n_restored"] == saved["n_saved"], restored
    msgs.append({"role": "user", "content": "Go on."})
    n, cached, _ = converse(demo_server, msgs)
    assert cached >= prev - 1
    for body, action, field in (({"filename": "../x"}, "save", "filename"), ({"filename": "nope.bin"}, "restore",
                                "filename"), ({}, "save", "filename"), ({"filename": "a"}, "delete", "action")):
        status, err = demo_server.request("POST", f"/slots/0?action={action}", body)
        assert status == 400 and err["error"]["param"] == field, (action, body, err)
    status, err = demo_server.request("POST", "/slots/7?action=erase")
    assert status == 400 and "does not exist" in err["error"]["message"]


def test_the_prompt_cache_survives_a_restart(tmp_path):
    """--prompt-cache-dir: a conversation computed before a restart (SIGTERM) is served from cache
    after it, as long as the model, context and KV type are the same."""
    args = ["-c", "4096", "-np", "1", "-t", "1", "--prompt-cache-dir", str(tmp_path / "cache")]
    messages = [{"role": "user", "content": FIRST}]
    srv = start_server(str(DEMO), args, tmp_path / "before.log", None)
    try:
        reply, usage, _ = chat(srv, messages)
    finally:
        stop_server(srv)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert "cached prompts kept in" in (tmp_path / "before.log").read_text()
    assert len(list((tmp_path / "cache").glob("*.hmprompt"))) == 1
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": FOLLOW_UPS[0]}]
    srv = start_server(str(DEMO), args, tmp_path / "after.log", None)
    try:
        _, usage2, _ = chat(srv, messages)
    finally:
        stop_server(srv)
    assert "1 cached prompts" in (tmp_path / "after.log").read_text()
    assert usage2["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1, usage2
