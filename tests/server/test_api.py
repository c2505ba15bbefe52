"""The OpenAI surface through the real `openai` client against a real `hybridmoe serve` process."""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import time

import openai
import pytest

from hybridmoe.synth import PRESETS

from .conftest import API_KEY

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]


def test_health_and_models(server, client, served_llm):
    status, body = server.request("GET", "/health", key=None)  # open without the key
    assert (status, body) == (200, {"status": "ok"})
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-test"]
    status, body = server.request("GET", "/v1/models")
    meta = body["data"][0]["meta"]
    assert meta["n_vocab"] == 1024 and meta["n_ctx_train"] == 4096 and meta["size"] > 0
    import os

    assert meta["n_params"] == _gpt_oss_params(PRESETS["tiny"].config)  # llama-server's field, counted
    assert meta["size"] == os.path.getsize(served_llm.path)


def _gpt_oss_params(c) -> int:
    """Weights of a gpt-oss model counted from its shape (embedding, head, and per layer: norms,
    q/k/v/o with biases, sinks, router, gate/up/down experts with biases)."""
    H, q, kv, E, I = c.hidden, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_experts, c.expert_ffn
    attn = (H * q + q) + 2 * (H * kv + kv) + (q * H + H) + c.n_heads
    moe = (H * E + E) + 2 * (H * I * E + I * E) + (I * H * E + H * E)
    return 2 * c.vocab_size * H + H + c.n_layers * (2 * H + attn + moe)


def test_chat_non_stream_equals_llm_generate(server, client, served_llm):
    r = client.chat.completions.create(model="tiny-test", messages=MSGS, max_tokens=10, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    timings = r.model_extra["timings"]
    assert timings["predicted_n"] == r.usage.completion_tokens and timings["prompt_n"] >= 1

    status, tpl = server.request("POST", "/apply-template", {"messages": MSGS})
    assert status == 200 and tpl["prompt"].endswith("<|start|>assistant")
    ids = served_llm.tokenize(tpl["prompt"])
    assert r.usage.prompt_tokens == len(ids)
    ref = served_llm.generate(ids, max_tokens=10, temperature=0.0)
    assert choice.message.content == ref.text  # --reasoning-format none: the raw text


def test_chat_stream_matches_non_stream(client):
    kw = dict(model="tiny-test", messages=MSGS, max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (full.choices[0].message.content or "")
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[0].choices[0].delta.role == "assistant"


def test_sampling_params_seed_and_logprobs(client):
    kw = dict(model="tiny-test", messages=MSGS, max_tokens=8, temperature=1.0, top_p=0.9, seed=7,
              extra_body={"min_p": 0.01, "top_k": 50})
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content  # same seed, same text
    r = client.chat.completions.create(model="tiny-test", messages=MSGS, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) >= 1
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob)  # greedy = top-1
    # llama-server adds each token's id (OpenAI's fields stay as they are)
    ids = [t.model_extra["id"] for t in content]
    assert all(isinstance(i, int) for i in ids) and content[0].top_logprobs[0].model_extra["id"] == ids[0]


def test_max_completion_tokens_and_usage_only_when_asked(client):
    kw = dict(model="tiny-test", messages=MSGS, temperature=0, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(max_completion_tokens=3, **kw)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    chunks = list(client.chat.completions.create(max_tokens=3, stream=True, **kw))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no stream_options.include_usage: no usage chunk


def test_streamed_logprobs_equal_non_stream(client):
    kw = dict(model="tiny-test", messages=MSGS, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
              extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [t for c in client.chat.completions.create(**kw, stream=True)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in full] and len(full) == 4
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in full], abs=1e-6)
    assert all(len(t.top_logprobs) == 2 for t in streamed)


@pytest.mark.parametrize("fmt", ["none", "auto"])
def test_stop_sequence(client, fmt):
    kw = dict(model="tiny-test", messages=MSGS, max_tokens=16, temperature=0,
              extra_body={"ignore_eos": True, "reasoning_format": fmt})
    text = client.chat.completions.create(**kw).choices[0].message.content
    assert len(text) > 4
    stop = text[2:4]
    r = client.chat.completions.create(**kw, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[: text.index(stop)]
    streamed = client.chat.completions.create(**kw, stop=[stop], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text[: text.index(stop)]


def test_legacy_completions(client):
    r = client.completions.create(model="tiny-test", prompt="Once upon a time", max_tokens=5, temperature=0,
                                  logprobs=1, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 5
    content = lp.model_extra["content"]  # llama-server's form of the same logprobs
    assert [c["logprob"] for c in content] == lp.token_logprobs and [c["token"] for c in content] == lp.tokens
    streamed = client.completions.create(model="tiny-test", prompt="Once upon a time", max_tokens=5,
                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text
    echoed = client.completions.create(model="tiny-test", prompt="Once upon a time", max_tokens=5, temperature=0,
                                       echo=True, extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == "Once upon a time" + r.choices[0].text


def test_tokenize_detokenize_round_trip(server):
    text = "Hello, wörld! 你好 🙂 <|start|>"
    status, tok = server.request("POST", "/tokenize", {"content": text})
    assert status == 200 and all(isinstance(i, int) for i in tok["tokens"])
    status, detok = server.request("POST", "/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and detok["content"] == text
    status, pieces = server.request("POST", "/tokenize", {"content": "hi there", "with_pieces": True})
    assert "".join(p["piece"] for p in pieces["tokens"]) == "hi there"


def test_props_slots_metrics(server, client):
    client.chat.completions.create(model="tiny-test", messages=MSGS, max_tokens=2, temperature=0)
    status, props = server.request("GET", "/props")
    assert status == 200 and props["total_slots"] == 4 and "<|start|>" in props["chat_template"]
    assert props["default_generation_settings"]["n_ctx"] == 1024
    # llama-server's switches and defaults: the session server runs --metrics, slots on
    assert (props["endpoint_slots"], props["endpoint_metrics"], props["endpoint_props"]) == (True, True, False)
    assert props["model_ftype"] == "MXFP4 MoE" and props["chat_template_caps"]["supports_tool_calls"] is True
    params = props["default_generation_settings"]["params"]
    assert params["speculative.types"] == "none" and params["ignore_eos"] is False and params["n_probs"] == 0
    status, slots = server.request("GET", "/slots")
    assert status == 200 and [s["id"] for s in slots] == [0, 1, 2, 3]
    status, text = server.request("GET", "/metrics")
    assert status == 200
    values = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}
    assert values["llamacpp:prompt_tokens_total"] > 0 and values["llamacpp:tokens_predicted_total"] > 0
    assert values["llamacpp:n_decode_total"] > 0


def test_eight_concurrent_streams_equal_alone(client):
    msgs = [[{"role": "user", "content": f"Tell story number {i}" + " please" * i}] for i in range(8)]
    kw = dict(model="tiny-test", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.chat.completions.create(messages=m, **kw).choices[0].message.content for m in msgs]

    def stream(m: list) -> str:
        return "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(messages=m, stream=True, **kw) if c.choices)

    with cf.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(stream, msgs, timeout=120))
    assert together == alone


BAD_BODIES = [
    ("malformed json", b'{"model": "tiny-test", "messages": [', 400),
    ("wrong type", {"model": "tiny-test", "messages": "hello"}, 400),
    ("wrong field type", {"model": "tiny-test", "messages": MSGS, "max_tokens": "lots"}, 400),
    ("missing messages", {"model": "tiny-test"}, 400),
    ("empty messages", {"model": "tiny-test", "messages": []}, 400),
    ("bad role", {"model": "tiny-test", "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("max_tokens 0", {"model": "tiny-test", "messages": MSGS, "max_tokens": 0}, 400),
    ("max_tokens negative", {"model": "tiny-test", "messages": MSGS, "max_tokens": -5}, 400),
    ("n above the slots", {"model": "tiny-test", "messages": MSGS, "n": 5}, 400),
    ("n zero", {"model": "tiny-test", "messages": MSGS, "n": 0}, 400),
    ("temperature negative", {"model": "tiny-test", "messages": MSGS, "temperature": -1}, 400),
    ("prompt too long", {"model": "tiny-test", "messages": [{"role": "user", "content": "word " * 1500}]}, 400),
    ("bad reasoning format", {"model": "tiny-test", "messages": MSGS, "reasoning_format": "loud"}, 400),
    ("image content", {"model": "tiny-test", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400),
    ("not an object", [1, 2, 3], 400),
    ("empty body", b"", 400),
    ("content a number", {"model": "tiny-test", "messages": [{"role": "user", "content": 5}]}, 400),
    ("too many stops", {"model": "tiny-test", "messages": MSGS, "stop": list("abcdef")}, 400),
    ("top_logprobs without logprobs", {"model": "tiny-test", "messages": MSGS, "top_logprobs": 2}, 400),
    ("top_logprobs too many", {"model": "tiny-test", "messages": MSGS, "logprobs": True, "top_logprobs": 50}, 400),
    ("malformed tools", {"model": "tiny-test", "messages": MSGS, "tools": [{"type": "function"}]}, 400),
    ("bad tool_choice", {"model": "tiny-test", "messages": MSGS, "tool_choice": "sometimes"}, 400),
    ("top_p zero", {"model": "tiny-test", "messages": MSGS, "top_p": 0}, 400),
]


@pytest.mark.parametrize("name,body,status", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_input_gets_openai_error_and_server_survives(server, client, name, body, status):
    got, err = server.request("POST", "/v1/chat/completions", body)
    assert got == status, err
    assert {"message", "type", "param", "code"} <= set(err["error"]) and err["error"]["message"]
    ok = client.chat.completions.create(model="tiny-test", messages=MSGS, max_tokens=1)
    assert ok.choices[0].finish_reason in ("stop", "length")


OTHER_BAD = [
    ("POST", "/v1/completions", {"model": "tiny-test", "prompt": []}),
    ("POST", "/v1/completions", {"model": "tiny-test", "prompt": ["a", "b"]}),
    ("POST", "/v1/completions", {"model": "tiny-test", "prompt": "x", "max_tokens": 0}),
    ("POST", "/tokenize", {"text": "missing content"}),
    ("POST", "/detokenize", {"tokens": [-1]}),
    ("POST", "/detokenize", {"tokens": "abc"}),
    ("POST", "/apply-template", {"messages": []}),
]


@pytest.mark.parametrize("method,path,body", OTHER_BAD, ids=[f"{m} {p} {i}" for i, (m, p, _) in enumerate(OTHER_BAD)])
def test_bad_input_other_endpoints(server, client, method, path, body):
    status, err = server.request(method, path, body)
    assert status == 400 and err["error"]["type"] == "invalid_request_error", err
    assert client.completions.create(model="tiny-test", prompt="ok", max_tokens=1).choices


def test_huge_max_tokens_is_clamped_to_the_context(client, server):
    # A scripted short reply keeps the test bounded; what matters is that 10**9 is accepted.
    server.script("Hi<|return|>")
    r = client.chat.completions.create(model="tiny-test", messages=MSGS, max_tokens=10**9)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == "Hi"


def test_bad_input_through_openai_client(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-test", messages=MSGS, n=9)  # more than the 4 slots
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-test", prompt=[5, 99999], max_tokens=2)
    # Any model name is served, as llama-server serves its one model whatever the client sends.
    for name in ("tiny.gguf", "gpt-oss-120b"):
        r = client.chat.completions.create(model=name, messages=MSGS, max_tokens=1)
        assert r.model == "tiny-test"


def test_api_key_required(server):
    from openai import OpenAI

    bad = OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    for key in ("wrong", None):  # the openai client refuses to send no key at all: plain HTTP
        status, body = server.request("POST", "/v1/chat/completions", {"messages": MSGS}, key=key)
        assert status == 401 and body["error"]["type"] == "authentication_error"
    assert server.request("GET", "/health", key=None)[0] == 200
    assert server.request("GET", "/v1/models", key=API_KEY)[0] == 200


def test_cors_preflight_needs_no_key(server):
    host, port = server.base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("OPTIONS", "/v1/chat/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("access-control-allow-origin") in ("*", "http://localhost:3000")
    conn.close()


def _busy_slots(server) -> int:
    return sum(s["is_processing"] for s in server.request("GET", "/slots")[1])


def _predicted_total(server) -> float:
    text = server.request("GET", "/metrics")[1]
    return float(next(ln.split()[1] for ln in text.splitlines() if ln.startswith("llamacpp:tokens_predicted_total")))


def test_client_disconnect_frees_slot(server):
    before = _predicted_total(server)
    host, port = server.base_url.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny-test", "messages": MSGS, "max_tokens": 400, "stream": True,
                       "ignore_eos": True})
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/chat/completions", body,
                 {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.fp.readline()  # the first SSE line: generation is under way
    deadline = time.monotonic() + 20
    while _busy_slots(server) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _busy_slots(server) == 1
    conn.sock.close()  # vanish mid-stream
    conn.close()
    deadline = time.monotonic() + 20
    while _busy_slots(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _busy_slots(server) == 0
    assert _predicted_total(server) - before < 400  # cancelled mid-way, not run to max_tokens
