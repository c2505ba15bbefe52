"""Duties every generating endpoint shares, checked on all of them, streamed and not: the counters
behind /metrics move the same way, and malformed harmony never fails a request (it comes back as
text or raw call arguments, the finish reason stays truthful, one warning per request)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from hybridmoe.engine.engine import Engine
from hybridmoe.server.app import ServerState
from hybridmoe.server.service import Service, ServiceConfig

from .conftest import ServerProcess
from .test_app_inprocess import InProcess

USER = [{"role": "user", "content": "Hi!"}]
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": PARAMETERS}]
MESSAGES_TOOLS = [{"name": "get_weather", "input_schema": PARAMETERS}]

# path, body (without `stream`), whether the reply is parsed by the chat format
ENDPOINTS = {
    "chat": ("/v1/chat/completions", {"messages": USER, "max_tokens": 48, "tools": CHAT_TOOLS}, True),
    "completions": ("/v1/completions", {"prompt": "Hi!", "max_tokens": 48}, False),
    "native": ("/completion", {"prompt": "Hi!", "n_predict": 48}, False),
    "responses": ("/v1/responses", {"input": "Hi!", "max_output_tokens": 48, "tools": RESPONSES_TOOLS}, True),
    "messages": ("/v1/messages", {"messages": USER, "max_tokens": 48, "tools": MESSAGES_TOOLS}, True),
}


def metrics(srv: InProcess) -> dict[str, float]:
    c = srv.conn()
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    return {k: float(v) for k, v in (line.split(" ") for line in text.splitlines() if not line.startswith("#"))}


def post(srv: InProcess, path: str, body: dict) -> tuple[int, str]:
    c = srv.conn()
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    out = (r.status, r.read().decode())
    c.close()
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_every_generating_endpoint_moves_the_counters(endpoint, stream, served_llm, served_model):
    engine = Engine(served_llm.loaded, 1, 256, 0, batch_size=64).start()
    state = ServerState(service=Service(engine, ServiceConfig(model_path=served_model)), metrics_enabled=True)
    path, body, _ = ENDPOINTS[endpoint]
    with InProcess(state) as srv:
        before = metrics(srv)
        status, text = post(srv, path, {**body, "stream": stream})
        assert status == 200, text
        after = metrics(srv)
    assert before["llamacpp:n_tokens_max"] == 0 and before["llamacpp:tokens_predicted_total"] == 0
    assert after["llamacpp:requests_total"] == 1
    predicted, prompt = after["llamacpp:tokens_predicted_total"], after["llamacpp:prompt_tokens_total"]
    assert predicted >= 1 and prompt >= 1
    assert after["llamacpp:n_tokens_max"] == prompt + predicted  # one request, nothing cached


# ---- malformed harmony -------------------------------------------------------------------------
# name: (the model's output, text the client must see somewhere in the reply, a call was made)
CORPUS = {
    "missing channel": ("<|start|>assistant<|message|>No channel here.<|end|>"
                        "<|start|>assistant<|channel|>final<|message|>Done.<|return|>", "No channel here.", False),
    "bad JSON in call arguments": ("<|channel|>commentary to=functions.get_weather <|constrain|>json"
                                   '<|message|>{"city": Par<|call|>', '{"city": Par', True),
    "unknown recipient": ('<|channel|>commentary to=browser.search<|message|>{"query": "x"}<|call|>',
                          '{"query": "x"}', False),
    "call without a function name": ("<|channel|>commentary to=functions.<|message|>{}<|call|>", "{}", False),
    "stray special token": ("<|channel|>final<|message|>Hi <|constrain|> there<|message|>!<|return|>", "there",
                            False),
    "header restarted": ("<|channel|>analysis<|start|>assistant<|channel|>final<|message|>ok<|return|>", "ok",
                         False),
    "text outside any message": ("plain words<|end|>more words<|return|>", "plain words", False),
    "message cut by another": ("<|channel|>analysis<|message|>thinking<|channel|>final<|message|>answer<|return|>",
                               "answer", False),
    "header never reaching a message": ("<|channel|>anon-ECh, in the same example, 0.5.<|return|>",
                                        "in the same example", False),
}


def sse_objects(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def visible(endpoint: str, body: str, stream: bool) -> tuple[str, str]:
    """(everything the client was shown as text, reasoning or call arguments; the finish reason)."""
    objs = sse_objects(body) if stream else [json.loads(body)]
    assert not any(o.get("error") or o.get("type") in ("error", "response.failed") for o in objs), body
    if endpoint == "chat":
        if stream:
            deltas = [c["delta"] for o in objs for c in o["choices"]]
            args = "".join(t["function"].get("arguments", "") for d in deltas for t in d.get("tool_calls") or [])
            text = "".join((d.get("content") or "") + (d.get("reasoning_content") or "") for d in deltas) + args
            return text, next(c["finish_reason"] for o in objs for c in o["choices"] if c["finish_reason"])
        m = objs[0]["choices"][0]["message"]
        calls = "".join(t["function"]["arguments"] for t in m.get("tool_calls") or [])
        return (m["content"] or "") + (m.get("reasoning_content") or "") + calls, objs[0]["choices"][0]["finish_reason"]
    if endpoint in ("completions", "native"):
        key = "text" if endpoint == "completions" else "content"
        parts = [c[key] for o in objs for c in (o["choices"] if endpoint == "completions" else [o])]
        last = objs[-1]["choices"][0] if endpoint == "completions" and objs[-1]["choices"] else objs[-1]
        return "".join(parts), last.get("finish_reason") or last.get("stop_type")
    if endpoint == "responses":
        resp = objs[-1]["response"] if stream else objs[0]
        text = ""
        for item in resp["output"]:
            text += "".join(p["text"] for p in item.get("content") or []) + item.get("arguments", "")
        return text, resp["status"]
    if stream:
        deltas = [o["delta"] for o in objs if o["type"] == "content_block_delta"]
        text = "".join(d.get("text", "") + d.get("thinking", "") + d.get("partial_json", "") for d in deltas)
        return text, next(o["delta"]["stop_reason"] for o in objs if o["type"] == "message_delta")
    content = objs[0]["content"]
    text = "".join(b.get("text", "") + b.get("thinking", "") + json.dumps(b.get("input", "")) for b in content)
    return text, objs[0]["stop_reason"]


def call(srv: ServerProcess, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(srv.base_url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {srv.api_key}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status, r.read().decode()


EXPECTED_FINISH = {  # (no call, call)
    "chat": ("stop", "tool_calls"), "completions": ("stop", "stop"), "native": ("eos", "eos"),
    "responses": ("completed", "completed"), "messages": ("end_turn", "tool_use")}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
@pytest.mark.parametrize("case", list(CORPUS))
def test_malformed_harmony_never_fails_a_request(case, endpoint, stream, scripted_server):
    output, shown, is_call = CORPUS[case]
    path, body, parsed = ENDPOINTS[endpoint]
    warnings = scripted_server.log().count("malformed model output")
    scripted_server.script(output)
    status, text = call(scripted_server, path, {**body, "stream": stream})
    assert status == 200, text
    seen, finish = visible(endpoint, text, stream)
    assert shown.replace('"', "") in seen.replace('\\"', "").replace('"', ""), (case, seen)
    assert finish == EXPECTED_FINISH[endpoint][is_call], (case, finish)
    assert scripted_server.log().count("malformed model output") == warnings + (1 if parsed else 0)
