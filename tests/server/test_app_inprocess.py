"""The app served by uvicorn in a thread of the test process, for states a real `serve` process
cannot easily be put in: still loading, failed to load, a full queue, a crashing model."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from hybridmoe.engine.engine import Engine
from hybridmoe.server.app import ServerState, create_app
from hybridmoe.server.service import Service, ServiceConfig

from .conftest import free_port

MSGS = [{"role": "user", "content": "Hello"}]


class InProcess:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.port = free_port()
        config = uvicorn.Config(create_app(state), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> InProcess:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.server.started
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        if self.state.service is not None:
            self.state.service.engine.close()

    def conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)

    def request(self, method: str, path: str, body: dict | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict]:
        c = self.conn()
        c.request(method, path, json.dumps(body) if body is not None else None,
                  {"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        out = (r.status, json.loads(r.read()))
        c.close()
        return out


@pytest.fixture
def make_service(served_llm, served_model):
    def make(n_parallel: int = 1, max_queue: int = 0) -> Service:
        engine = Engine(served_llm.loaded, n_parallel, 256, max_queue, batch_size=64).start()
        return Service(engine, ServiceConfig(model_path=served_model))

    return make


def test_health_while_loading_and_after_failure():
    state = ServerState()
    with InProcess(state) as srv:
        status, body = srv.request("GET", "/health")
        assert status == 503 and body["error"]["message"] == "Loading model"
        assert body["error"]["type"] == "unavailable_error"
        status, body = srv.request("POST", "/v1/chat/completions", {"messages": MSGS})
        assert status == 503
        state.load_error = "GGUFError: bad magic"
        status, body = srv.request("GET", "/health")
        assert status == 503 and "bad magic" in body["error"]["message"]


def test_full_queue_answers_503_then_recovers(make_service):
    state = ServerState(service=make_service(n_parallel=1, max_queue=0))
    engine = state.service.engine
    with InProcess(state) as srv:
        c = srv.conn()
        c.request("POST", "/v1/chat/completions", json.dumps(
            {"messages": MSGS, "stream": True, "max_tokens": 200, "ignore_eos": True}),
            {"Content-Type": "application/json"})
        r = c.getresponse()
        r.fp.readline()  # first chunk: the only slot is busy
        status, body = srv.request("POST", "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2})
        assert status == 503 and "busy" in body["error"]["message"]
        assert srv.request("GET", "/slots?fail_on_no_slot=1")[0] == 503
        c.close()
        deadline = time.monotonic() + 20
        while engine.status()["slots"][0]["is_processing"] and time.monotonic() < deadline:
            time.sleep(0.05)
        status, body = srv.request("POST", "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2})
        assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")
        assert engine.metrics.requests_rejected_total == 1
        assert srv.request("GET", "/slots?fail_on_no_slot=1")[0] == 200


def test_non_stream_disconnect_frees_slot(make_service, monkeypatch):
    state = ServerState(service=make_service(n_parallel=1, max_queue=4))
    engine = state.service.engine
    real_forward = engine.runner.model.forward

    def paced(chunks, all_logits=False):  # 5 ms a step: the token count measures detection latency
        time.sleep(0.005)                  # the same way however fast the tiny model runs here
        return real_forward(chunks, all_logits)

    monkeypatch.setattr(engine.runner.model, "forward", paced)
    with InProcess(state) as srv:
        body = json.dumps({"messages": MSGS, "max_tokens": 230, "ignore_eos": True}).encode()
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 20
        while not engine.status()["slots"][0]["is_processing"] and time.monotonic() < deadline:
            time.sleep(0.01)
        s.close()
        while engine.status()["slots"][0]["is_processing"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.status()["slots"][0]["is_processing"]
        # Stopped soon after the disconnect (a middleware that hides it let ~160 tokens run).
        assert engine.metrics.tokens_predicted_total < 115


def test_model_failure_is_an_error_not_a_crash(make_service, monkeypatch):
    state = ServerState(service=make_service(n_parallel=2, max_queue=4))
    model = state.service.engine.runner.model
    real_forward = model.forward
    calls = {"n": 0}

    def flaky(chunks, all_logits=False):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel failure")
        return real_forward(chunks, all_logits)

    monkeypatch.setattr(model, "forward", flaky)
    with InProcess(state) as srv:
        status, body = srv.request("POST", "/v1/chat/completions", {"messages": MSGS, "max_tokens": 3})
        assert status == 500 and "simulated kernel failure" in body["error"]["message"]
        status, body = srv.request("POST", "/v1/chat/completions", {"messages": MSGS, "max_tokens": 3})
        assert status == 200 and body["usage"]["completion_tokens"] >= 1


def test_chat_template_file_overrides_the_gguf_template(served_llm, served_model):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}<|start|>assistant"
    engine = Engine(served_llm.loaded, 1, 256, 0).start()
    state = ServerState(service=Service(engine, ServiceConfig(model_path=served_model,
                                                                          chat_template=template)))
    with InProcess(state) as srv:
        status, body = srv.request("POST", "/apply-template", {"messages": MSGS})
        assert status == 200 and body["prompt"] == "[user] Hello\n<|start|>assistant"
        status, body = srv.request("POST", "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2})
        assert status == 200
        assert body["usage"]["prompt_tokens"] == len(served_llm.tokenize("[user] Hello\n<|start|>assistant"))


def test_several_api_keys_and_metrics_off(make_service):
    state = ServerState(api_keys=["k1", "k2"], service=make_service())  # metrics_enabled: False
    with InProcess(state) as srv:
        assert srv.request("GET", "/v1/models")[0] == 401
        assert srv.request("GET", "/v1/models", headers={"Authorization": "Bearer k3"})[0] == 401
        for h in ({"Authorization": "Bearer k1"}, {"Authorization": "Bearer k2"}, {"x-api-key": "k2"}):
            assert srv.request("GET", "/v1/models", headers=h)[0] == 200, h
        assert srv.request("GET", "/health")[0] == 200
        # Without --metrics: llama-server's 501 "not supported", as an OpenAI error object.
        status, body = srv.request("GET", "/metrics", headers={"Authorization": "Bearer k1"})
        assert status == 501 and body["error"]["type"] == "not_supported_error"
        assert "--metrics" in body["error"]["message"]


def test_server_defaults_for_requests_that_leave_fields_out(served_llm, served_model):
    """--ignore-eos, --reasoning-effort and --no-cache-prompt set what a request leaves out; the
    request's own value wins, and a constrained request is never held past its end."""
    engine = Engine(served_llm.loaded, 1, 256, 0, batch_size=64).start()
    config = ServiceConfig(model_path=served_model, ignore_eos=True, reasoning_effort="high", cache_prompt=False)
    with InProcess(ServerState(service=Service(engine, config))) as srv:
        _, r = srv.request("POST", "/completion", {"prompt": "Hello", "n_predict": 3})
        assert r["generation_settings"]["ignore_eos"] is True
        _, r = srv.request("POST", "/completion", {"prompt": "Hello", "n_predict": 3, "ignore_eos": False})
        assert r["generation_settings"]["ignore_eos"] is False
        status, r = srv.request("POST", "/completion", {"prompt": "Hello", "n_predict": 8,
                                                         "json_schema": {"type": "integer"}})
        assert status == 200 and r["generation_settings"]["ignore_eos"] is False
        _, t = srv.request("POST", "/apply-template", {"messages": MSGS})
        assert "Reasoning: high" in t["prompt"]
        _, t = srv.request("POST", "/apply-template", {"messages": MSGS, "reasoning_effort": "low"})
        assert "Reasoning: low" in t["prompt"]
        for _ in range(2):  # the same prompt twice: nothing reused
            _, r = srv.request("POST", "/completion", {"prompt": "Hello there, how are you", "n_predict": 2})
        assert r["timings"]["cache_n"] == 0
        _, r = srv.request("POST", "/completion", {"prompt": "Hello there, how are you", "n_predict": 2,
                                                   "cache_prompt": True})
        assert r["timings"]["cache_n"] > 0
