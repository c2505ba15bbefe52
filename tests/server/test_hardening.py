"""Hostile but fair requests get a 400/413 naming the field, never a 500; HEAD is served where
GET is; the OpenAPI schema is published behind the API key; bad ports fail fast in one line."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import API_KEY, LLAMA_LINE, ServerProcess, free_port, start_server, stop_server

MSG = [{"role": "user", "content": "Hello"}]


def _chat(**extra: object) -> dict:
    return {"messages": MSG, "max_tokens": 2, **extra}


def _assert_400(status: int, answer: object, param: str) -> None:
    assert status == 400, (status, answer)
    err = answer["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert err["message"].startswith(param), err


@pytest.mark.parametrize("key", ["tools", "add_generation_prompt", "messages"])
def test_template_kwargs_clashing_with_the_renderer(server: ServerProcess, key: str):
    for path, body in (("/v1/chat/completions", _chat(chat_template_kwargs={key: 1})),
                       ("/apply-template", {"messages": MSG, "chat_template_kwargs": {key: 1}})):
        status, answer = server.request("POST", path, body)
        _assert_400(status, answer, f"chat_template_kwargs.{key}")


def test_other_template_kwargs_are_plain_template_variables(server: ServerProcess):
    # "template" was refused only while it was a Python parameter of render_chat.
    status, answer = server.request("POST", "/apply-template", {"messages": MSG, "chat_template_kwargs": {"template": 1}})
    assert status == 200 and answer["prompt"], answer


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "a\ud800b"}]), "messages.0.content"),
    ("/v1/completions", {"prompt": "x\udc00", "max_tokens": 2}, "prompt"),
    ("/tokenize", {"content": "a\ud800b"}, "content"),
    ("/v1/chat/completions", _chat(stop=["ok", "\ud800"]), "stop.1"),
])
def test_lone_surrogates(server: ServerProcess, path: str, body: dict, param: str):
    raw = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as a \ud800 escape
    assert b"\\ud" in raw or b"\\udc" in raw
    status, answer = server.request("POST", path, raw)
    _assert_400(status, answer, param)
    assert "surrogate" in answer["error"]["message"]
    # A valid escaped pair is one character, not an error.
    status, answer = server.request("POST", "/tokenize", json.dumps({"content": "\U0001F600"}).encode())
    assert status == 200 and answer["tokens"]


@pytest.mark.parametrize("seed", [2**64, 2**64 + 5, 10**30, -(2**63) - 1])
def test_seed_outside_64_bits(server: ServerProcess, seed: int):
    status, answer = server.request("POST", "/v1/chat/completions", _chat(seed=seed))
    _assert_400(status, answer, "seed")


@pytest.mark.parametrize("seed", [2**64 - 1, -1, -(2**63), 0])
def test_seed_at_the_64_bit_edges_is_served(server: ServerProcess, seed: int):
    status, answer = server.request("POST", "/v1/chat/completions", _chat(seed=seed))
    assert status == 200, answer


def test_deeply_nested_tool_parameters(server: ServerProcess):
    params: dict = {"type": "string"}
    for _ in range(300):
        params = {"type": "object", "properties": {"x": params}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g", "parameters": params}}]
    status, answer = server.request("POST", "/v1/chat/completions", _chat(tools=tools))
    _assert_400(status, answer, "tools.1.function.parameters")


def test_deep_tool_call_arguments_are_a_400_not_a_recursion_500(server: ServerProcess):
    # Written by hand: the client's own json.dumps would hit the recursion limit.
    deep = '{"a": ' * 900 + "{}" + "}" * 900
    body = ('{"max_tokens": 2, "messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", '
            '"tool_calls": [{"id": "1", "function": {"name": "f", "arguments": ' + deep + '}}]}, '
            '{"role": "tool", "tool_call_id": "1", "content": "ok"}]}')
    status, answer = server.request("POST", "/v1/chat/completions", body.encode())
    assert status == 400, answer


def test_body_over_the_limit_is_a_413_before_it_is_read(server: ServerProcess):
    big = json.dumps(_chat(messages=[{"role": "user", "content": "x" * (9 << 20)}])).encode()
    t0 = time.monotonic()
    status, answer = server.request("POST", "/v1/chat/completions", big)
    assert status == 413 and answer["error"]["code"] == "request_too_large", answer
    assert "--max-body-size" in answer["error"]["message"]
    assert time.monotonic() - t0 < 10
    assert server.request("POST", "/v1/chat/completions", _chat())[0] == 200


def test_chunked_body_over_the_limit_is_a_413(server: ServerProcess):
    conn = http.client.HTTPConnection(server.base_url.removeprefix("http://"), timeout=60)
    chunk = b" " * (1 << 20)
    conn.request("POST", "/tokenize", body=iter([b'{"content": "', *[chunk] * 10, b'"}']),
                 headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
                 encode_chunked=True)
    r = conn.getresponse()
    assert r.status == 413 and json.loads(r.read())["error"]["code"] == "request_too_large"
    conn.close()


def test_prompt_over_the_context_is_refused_without_tokenizing_it_all(server: ServerProcess):
    # ~7 MB of text (under the body limit) against a 1024-token slot.
    body = _chat(messages=[{"role": "user", "content": "hello world " * 600_000}])
    t0 = time.monotonic()
    status, answer = server.request("POST", "/v1/chat/completions", body)
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
    assert answer["error"]["param"] == "messages"
    status, answer = server.request("POST", "/v1/completions", {"prompt": "hello world " * 600_000})
    assert status == 400 and answer["error"]["param"] == "prompt", answer
    assert time.monotonic() - t0 < 30


def test_head_is_served_wherever_get_is(server: ServerProcess):
    for path in ("/health", "/v1/models", "/props", "/slots", "/metrics"):
        conn = http.client.HTTPConnection(server.base_url.removeprefix("http://"), timeout=30)
        conn.request("HEAD", path, headers={"Authorization": f"Bearer {API_KEY}"})
        r = conn.getresponse()
        assert r.status == 200, (path, r.status)
        assert r.read() == b"" and int(r.getheader("content-length")) > 0
        conn.close()
    status, _ = server.request("HEAD", "/v1/chat/completions")
    assert status == 405  # POST-only routes stay POST-only


def test_openapi_schema_is_published_behind_the_key(server: ServerProcess):
    status, spec = server.request("GET", "/openapi.json")
    assert status == 200 and "/v1/chat/completions" in spec["paths"]
    status, answer = server.request("GET", "/openapi.json", key=None)
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"


# ---- process: the port is bound before the model loads --------------------------------------

def _serve(model: str, *args: str, timeout: float = 30) -> tuple[int, list[str], float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "hybridmoe.cli", "serve", "-m", model, *args],
                       capture_output=True, text=True, timeout=timeout, env=env)
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    return p.returncode, lines, time.monotonic() - t0


def test_port_in_use_bad_port_and_foreign_address_fail_fast_in_one_line(served_model: str):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        cases = [(["--host", "127.0.0.1", "--port", str(port)], "in use"),
                 (["--host", "127.0.0.1", "--port", "70000"], "70000"),
                 (["--host", "192.0.2.1", "--port", str(free_port())], "192.0.2.1")]  # TEST-NET-1
        for args, needle in cases:
            code, lines, _ = _serve(served_model, *args)
            assert code not in (0, -signal.SIGABRT, 134), (args, code, lines)
            assert len(lines) == 1 and needle in lines[0] and "Traceback" not in lines[0], (args, lines)


def test_sigterm_ends_a_long_stream_after_the_grace_period(served_model: str, tmp_path: Path):
    srv = start_server(served_model, ["-np", "1", "-c", "4096", "-t", "1", "--shutdown-grace", "1",
                                      "--host", "127.0.0.1"], tmp_path / "s.log", None)
    try:
        conn = http.client.HTTPConnection(srv.base_url.removeprefix("http://"), timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(
            {"prompt": "Hello", "max_tokens": 4000, "ignore_eos": True, "stream": True}),
            {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200
        first = r.readline()  # http.client undoes the chunked encoding
        assert first.startswith(b"data: "), first
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        rest = r.read().decode()
        elapsed = time.monotonic() - t0
        events = [ln[6:] for ln in rest.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        final = json.loads(events[-2])
        assert final["error"]["code"] == "server_shutting_down", final
        assert elapsed < 1 + 5, elapsed
        srv.proc.wait(timeout=15)
        assert srv.proc.returncode != -signal.SIGABRT
    finally:
        if srv.proc.poll() is None:
            stop_server(srv)


def test_sigterm_while_idle_exits_at_once(served_model: str, tmp_path: Path):
    srv = start_server(served_model, LLAMA_LINE + ["-np", "1"], tmp_path / "s.log", API_KEY)
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    srv.proc.wait(timeout=15)
    assert time.monotonic() - t0 < 5 and srv.proc.returncode != -signal.SIGABRT
