"""llama-server drop-in behaviours (issue 14), each through a real client against a real
`hybridmoe serve` process: the native /completion API, n > 1, llama-server's errors, flags,
/slots, /metrics, CORS, several --host addresses, and what templates receive."""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import socket
import time
import urllib.request
from collections.abc import Iterator

import openai
import pytest

from .conftest import API_KEY, ServerProcess, start_server, stop_server

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
GREEDY = {"temperature": 0, "ignore_eos": True}


def sse(srv: ServerProcess, path: str, body: dict, key: str | None = API_KEY) -> list[dict | str]:
    """POST and read a server-sent event stream: the decoded `data:` payloads ("[DONE]" kept)."""
    host, port = srv.base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    conn.request("POST", path, json.dumps(body), headers)
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    assert resp.getheader("content-type").startswith("text/event-stream")
    out: list[dict | str] = []
    for raw in resp.read().decode().split("\n\n"):
        if raw.startswith("data: "):
            data = raw[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    conn.close()
    return out


# ---- native /completion -----------------------------------------------------------------------

@pytest.mark.parametrize("ctype", ["application/x-www-form-urlencoded", "text/plain"])
def test_json_bodies_are_read_whatever_the_content_type(server, ctype):
    """`curl -d '{...}'` without -H sends form encoding; llama-server reads the body as JSON anyway,
    and so do we (the same result as with the JSON content type). A body that is not JSON is still
    a 400 naming the problem."""
    body = {"prompt": "Once upon a time", "n_predict": 4, **GREEDY}
    status, as_json = server.request("POST", "/completion", body)
    status2, as_form = server.request("POST", "/completion", json.dumps(body).encode(), headers={"Content-Type": ctype})
    assert status == status2 == 200, as_form
    assert as_form["content"] == as_json["content"] and as_form["tokens_predicted"] == 4
    chat = {"messages": MSGS, "max_tokens": 3, **GREEDY}
    status, r = server.request("POST", "/v1/chat/completions", json.dumps(chat).encode(),
                               headers={"Content-Type": ctype})
    assert status == 200 and r["usage"]["completion_tokens"] == 3, r
    status, err = server.request("POST", "/completion", b"prompt=hello", headers={"Content-Type": ctype})
    assert status == 400 and "JSON" in err["error"]["message"], err



def test_native_completion_string_prompt_matches_generate(server, served_llm):
    status, r = server.request("POST", "/completion", {"prompt": "Once upon a time", "n_predict": 6,
                                                      "return_tokens": True, **GREEDY})
    assert status == 200, r
    ref = served_llm.generate(served_llm.tokenize("Once upon a time"), max_tokens=6, temperature=0.0,
                              ignore_eos=True)
    assert r["content"] == ref.text and len(r["tokens"]) == 6
    assert r["stop"] is True and r["stop_type"] == "limit" and r["stopping_word"] == ""
    assert r["tokens_predicted"] == 6 and r["tokens_evaluated"] == len(served_llm.tokenize("Once upon a time"))
    assert r["timings"]["predicted_n"] == 6 and r["model"] == "tiny-test" and 0 <= r["id_slot"] < 4
    t = r["timings"]
    assert t["predicted_per_token_ms"] == pytest.approx(t["predicted_ms"] / 5)  # the first token is not decoded
    assert t["prompt_per_token_ms"] == pytest.approx(t["prompt_ms"] / t["prompt_n"])
    gs = r["generation_settings"]
    assert gs["n_predict"] == 6 and gs["temperature"] == 0 and gs["n_ctx"] == 1024 and gs["ignore_eos"] is True
    assert r["prompt"] == "Once upon a time" and r["truncated"] is False


def test_native_prompt_as_ids_and_mixed(server, served_llm):
    ids = served_llm.tokenize("Once upon a time")
    body = {"n_predict": 4, **GREEDY}
    _, as_text = server.request("POST", "/completion", {"prompt": "Once upon a time", **body})
    _, as_ids = server.request("POST", "/completion", {"prompt": ids, **body})
    _, mixed = server.request("POST", "/completion", {"prompt": [*ids, " and then"], **body})
    _, joined = server.request("POST", "/completion", {"prompt": ids + served_llm.tokenize(" and then"), **body})
    assert as_text["content"] == as_ids["content"] and mixed["content"] == joined["content"]
    assert mixed["tokens_evaluated"] == len(ids) + len(served_llm.tokenize(" and then"))
    assert as_ids["tokens"] == []  # return_tokens false: empty, as llama-server
    status, several = server.request("POST", "/completion", {"prompt": ["Once upon", ids], **body})
    assert status == 200 and isinstance(several, list) and [r["index"] for r in several] == [0, 1]
    assert several[1]["content"] == as_text["content"]


def test_native_stop_types_and_word(server):
    _, free = server.request("POST", "/completion", {"prompt": "Hello", "n_predict": 12, **GREEDY})
    text = free["content"]
    word = text[3:5]
    _, stopped = server.request("POST", "/completion", {"prompt": "Hello", "n_predict": 12, "stop": [word], **GREEDY})
    assert stopped["stop_type"] == "word" and stopped["stopping_word"] == word
    assert stopped["content"] == text[: text.index(word)]
    server.script("Hi<|return|>")
    _, eos = server.request("POST", "/completion", {"prompt": "Hello", "n_predict": 20, "temperature": 0})
    assert eos["stop_type"] == "eos" and eos["content"] == "Hi"


def test_native_n_probs_and_samplers(server):
    _, r = server.request("POST", "/completion", {"prompt": "Hello", "n_predict": 3, "n_probs": 2, **GREEDY})
    probs = r["completion_probabilities"]
    assert len(probs) == 3 and all(len(p["top_logprobs"]) == 2 for p in probs)
    assert probs[0]["id"] == probs[0]["top_logprobs"][0]["id"] and probs[0]["logprob"] <= 0
    assert bytes(probs[0]["bytes"]).decode(errors="ignore") == probs[0]["token"]
    # samplers: top_k only (k=1) at temperature 1 is greedy whatever the seed.
    body = {"prompt": "Hello", "n_predict": 5, "temperature": 1.0, "top_k": 1, "ignore_eos": True}
    a = server.request("POST", "/completion", {**body, "samplers": ["top_k", "temperature"], "seed": 1})[1]
    b = server.request("POST", "/completion", {**body, "samplers": "kt", "seed": 2})[1]
    assert a["content"] == b["content"] == server.request("POST", "/completion", {**body, **GREEDY})[1]["content"]
    assert a["generation_settings"]["samplers"] == ["top_k", "temperature"]
    status, err = server.request("POST", "/completion", {**body, "samplers": ["magic"]})
    assert status == 400 and "samplers" in err["error"]["message"]


def test_native_stream_chunks_and_final(server):
    body = {"prompt": "Once upon a time", "n_predict": 5, **GREEDY}
    _, full = server.request("POST", "/completion", body)
    events = sse(server, "/completion", {**body, "stream": True})
    assert "[DONE]" not in events  # llama-server's native stream has no [DONE] line
    tokens, final = events[:-1], events[-1]
    assert all(e["stop"] is False and len(e["tokens"]) == 1 for e in tokens)
    assert "".join(e["content"] for e in tokens) == full["content"]
    assert final["stop"] is True and final["content"] == "" and final["stop_type"] == "limit"
    assert final["timings"]["predicted_n"] == 5


def test_native_return_progress(server):
    prompt = "The long prompt " * 60  # several 64-token prompt batches (-b 64)
    events = sse(server, "/completion", {"prompt": prompt, "n_predict": 2, "stream": True, "return_progress": True,
                                         **GREEDY})
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    assert progress, events[:3]
    assert progress[-1]["processed"] == progress[-1]["total"] > 64
    processed = [p["processed"] for p in progress]  # pushed after each prompt batch, in order
    assert processed == sorted(set(processed)) and len(processed) > 1
    assert all(p["total"] == progress[-1]["total"] and isinstance(p["time_ms"], int) for p in progress)
    first_token = next(i for i, e in enumerate(events) if e.get("tokens"))
    assert all("prompt_progress" in e for e in events[:first_token])
    # The same on the OpenAI endpoints.
    chunks = sse(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}],
                                                  "max_tokens": 2, "stream": True, "return_progress": True, **GREEDY})
    assert any("prompt_progress" in c for c in chunks if isinstance(c, dict))


def test_native_completions_path_is_native_and_json_schema(server):
    status, r = server.request("POST", "/completions", {"prompt": "Hi", "n_predict": 2, **GREEDY})
    assert status == 200 and "content" in r and "choices" not in r  # llama-server: /completions is native
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    _, r = server.request("POST", "/completion", {"prompt": "JSON:", "n_predict": 60, "json_schema": schema,
                                                  "temperature": 0})
    assert isinstance(json.loads(r["content"])["a"], int)
    status, r = server.request("POST", "/completion", {"prompt": "x", "grammar": 'root ::= "yes" | "no"',
                                                       "n_predict": 5, "temperature": 0})
    assert status == 200 and r["content"] in ("yes", "no"), r
    status, err = server.request("POST", "/completion", {"prompt": "x", "json_schema": {"type": "wat"}})
    assert status == 400 and err["error"]["param"].startswith("json_schema")


def test_native_n_cmpl_and_cache_prompt(server):
    body = {"prompt": "Tell me a story about a cat", "n_predict": 3, **GREEDY}
    status, r = server.request("POST", "/completion", {**body, "n_cmpl": 2})
    assert status == 200 and len(r) == 2 and r[0]["content"] == r[1]["content"]
    _, again = server.request("POST", "/completion", {**body, "cache_prompt": True})
    assert again["timings"]["cache_n"] > 0  # the prompt's prefix came from a slot's cache
    _, fresh = server.request("POST", "/completion", {**body, "cache_prompt": False})
    assert fresh["timings"]["cache_n"] == 0 and fresh["content"] == again["content"]


# ---- OpenAI endpoints -------------------------------------------------------------------------

def test_n_choices_chat_and_completions(client):
    r = client.chat.completions.create(model="any-name", messages=MSGS, n=2, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy: the same text
    assert r.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(model="x", messages=MSGS, n=2, max_tokens=4, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in (0, 1)]
    assert texts == [r.choices[0].message.content] * 2
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1]
    cr = client.completions.create(model="x", prompt="Hello", n=3, max_tokens=2, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert [c.index for c in cr.choices] == [0, 1, 2]


def test_n_predict_in_v1_completions(client):
    r = client.completions.create(model="x", prompt="Hello", extra_body={"n_predict": 8, **GREEDY})
    assert r.usage.completion_tokens == 8  # n_predict wins over the legacy default of 16
    r = client.completions.create(model="x", prompt="Hello", max_tokens=30, extra_body={"n_predict": 3, **GREEDY})
    assert r.usage.completion_tokens == 3


def test_prompt_too_long_is_exceed_context_size_error(server, client):
    body = {"messages": [{"role": "user", "content": "word " * 1500}]}
    status, err = server.request("POST", "/v1/chat/completions", body)
    assert status == 400 and err["error"]["type"] == "exceed_context_size_error"
    assert err["error"]["n_ctx"] == 1024 and err["error"]["n_prompt_tokens"] > 1024
    status, err = server.request("POST", "/completion", {"prompt": "word " * 1500})
    assert status == 400 and err["error"]["type"] == "exceed_context_size_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="x", prompt="word " * 1500)
    assert e.value.body["type"] == "exceed_context_size_error"


BAD_HISTORIES = [
    ("two assistants at the end", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                   {"role": "assistant", "content": "c"}], "messages[2] (role 'assistant')"),
    ("malformed tool-call arguments", [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}], "messages[1] (role 'assistant')"),
]


@pytest.mark.parametrize("name,messages,where", BAD_HISTORIES, ids=[b[0] for b in BAD_HISTORIES])
def test_bad_history_is_400_naming_index_and_role(server, name, messages, where):
    status, err = server.request("POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert status == 400 and where in err["error"]["message"], err


def test_continue_final_message_rules(server):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello the"}]
    status, err = server.request("POST", "/apply-template", {"messages": msgs, "continue_final_message": True})
    assert status == 400 and "add_generation_prompt" in err["error"]["message"]
    status, r = server.request("POST", "/apply-template", {"messages": msgs, "continue_final_message": True,
                                                           "add_generation_prompt": False})
    assert status == 200 and r["prompt"].endswith("<|start|>assistant<|channel|>final<|message|>Hello the")
    # A trailing assistant message alone is continued (llama-server's prefill), not answered.
    _, auto = server.request("POST", "/apply-template", {"messages": msgs})
    assert auto["prompt"] == r["prompt"]
    server.script(" cat<|return|>")
    status, chat = server.request("POST", "/v1/chat/completions", {
        "messages": msgs, "max_tokens": 3, "temperature": 0, "reasoning_format": "auto"})
    assert status == 200 and chat["choices"][0]["message"]["content"] == " cat"  # only the continuation


def test_apply_template_add_generation_prompt_false(server):
    _, with_gen = server.request("POST", "/apply-template", {"messages": MSGS})
    _, without = server.request("POST", "/apply-template", {"messages": MSGS, "add_generation_prompt": False})
    assert with_gen["prompt"].endswith("<|start|>assistant")
    assert with_gen["prompt"] == without["prompt"] + "<|start|>assistant"


def test_earlier_tool_call_reasoning_stays_in_the_prompt(server):
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "reasoning_content": "I should call get_weather.",
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                          "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "user", "content": "and tomorrow?"}]
    _, r = server.request("POST", "/apply-template", {"messages": msgs})
    assert "<|channel|>analysis<|message|>I should call get_weather.<|end|>" in r["prompt"]
    done = msgs[:3] + [{"role": "assistant", "content": "Sunny.", "reasoning_content": "easy"},
                       {"role": "user", "content": "thanks"}]
    _, r = server.request("POST", "/apply-template", {"messages": done})
    assert "I should call get_weather." not in r["prompt"] and "easy" not in r["prompt"]  # a final answer follows


def test_stream_usage_chunk_carries_timings(client):
    chunks = list(client.chat.completions.create(model="x", messages=MSGS, max_tokens=3, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    usage_chunk, finish_chunk = chunks[-1], chunks[-2]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.model_extra["timings"]["predicted_n"] == usage_chunk.usage.completion_tokens
    assert "timings" not in (finish_chunk.model_extra or {})
    plain = list(client.chat.completions.create(model="x", messages=MSGS, max_tokens=3, temperature=0, stream=True))
    assert "timings" in plain[-1].model_extra  # without usage: on the finish chunk


def test_input_tokens_counts_the_prompt(server, client):
    status, r = server.request("POST", "/v1/chat/completions/input_tokens", {"messages": MSGS})
    full = client.chat.completions.create(model="x", messages=MSGS, max_tokens=1)
    assert status == 200 and r["input_tokens"] == full.usage.prompt_tokens


def test_metrics_use_llama_server_names(server, client):
    for _ in range(2):  # the second run reuses the first's prompt from the slot's cache
        client.chat.completions.create(model="x", messages=MSGS, max_tokens=2, temperature=0)
    _, text = server.request("GET", "/metrics")
    values = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}
    for name in ("prompt_tokens_total", "prompt_tokens_cached_total", "prompt_seconds_total",
                 "tokens_predicted_total", "tokens_predicted_seconds_total", "n_decode_total", "n_tokens_max",
                 "prompt_tokens_seconds", "predicted_tokens_seconds", "requests_processing", "requests_deferred",
                 "n_busy_slots_per_decode", "spec_decode_num_draft_tokens_total"):
        assert f"llamacpp:{name}" in values, name
    assert values["llamacpp:prompt_tokens_cached_total"] > 0 and values["llamacpp:n_tokens_max"] > 0


def test_cors_preflight_echoes_origin_with_credentials(server):
    host, port = server.base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("OPTIONS", "/v1/chat/completions", headers={
        "Origin": "http://frontend.example:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    r = conn.getresponse()
    r.read()
    assert r.status == 200 and r.getheader("access-control-allow-origin") == "http://frontend.example:3000"
    assert r.getheader("access-control-allow-credentials") == "true"
    assert r.getheader("access-control-allow-headers") == "authorization,content-type"
    assert "POST" in r.getheader("access-control-allow-methods")
    conn.request("GET", "/v1/models", headers={"Origin": "http://frontend.example:3000",
                                                "Authorization": f"Bearer {API_KEY}"})
    r = conn.getresponse()
    r.read()
    assert r.status == 200 and r.getheader("access-control-allow-origin") == "http://frontend.example:3000"


def test_public_routes_with_api_key(server):
    assert server.request("GET", "/health", key=None)[0] == 200
    assert server.request("GET", "/", key=None)[0] != 401  # the web UI page asks for the key itself
    assert server.request("GET", "/v1/models", key=None)[0] == 401  # as the newest llama-server
    assert server.request("POST", "/completion", {"prompt": "x"}, key=None)[0] == 401


# ---- servers started with llama-server flags ----------------------------------------------------

@pytest.fixture(scope="module")
def flagged(served_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Two slots; --seed, aliases and tags, -n, --verbose, --no-slots, --reasoning off, --swa-full,
    --context-shift, a CORS allow-list, both loopback addresses, sampler flags (order, logit bias,
    penalties, DRY); replies can be scripted."""
    logs = tmp_path_factory.mktemp("logs")
    srv = start_server(served_model, [
        "-np", "2", "-t", "1", "--seed", "42", "--alias", "tiny-b,tiny-a", "--tags", "small,test", "-n", "5",
        "--verbose", "--no-slots", "--reasoning", "off", "--swa-full", "--context-shift",
        "--cors-origins", "http://good.example", "--host", "127.0.0.1,::1", "--samplers", "top_k;temperature",
        "-l", "77+1000", "--repeat-penalty", "1.3", "--dry-multiplier", "0.5", "--dry-sequence-breaker", "@"],
        logs / "flagged.log", None, logs / "script.json")
    yield srv
    stop_server(srv)


def test_flags_seed_alias_tags_n_predict_verbose(flagged):
    status, props = flagged.request("GET", "/props")
    assert props["default_generation_settings"]["params"]["seed"] == 42
    assert props["default_generation_settings"]["params"]["n_predict"] == 5
    _, models = flagged.request("GET", "/v1/models")
    m = models["data"][0]
    assert m["id"] == "tiny-a" and m["aliases"] == ["tiny-a", "tiny-b"] and m["tags"] == ["small", "test"]
    assert m["meta"]["n_ctx"] == props["default_generation_settings"]["n_ctx"] and m["meta"]["n_vocab"] > 0
    assert m["meta"]["vocab_type"] == 2 and m["meta"]["ftype"] == "MXFP4 MoE"  # gpt2 BPE; general.file_type 38
    assert m["architecture"] == {"input_modalities": ["text"], "output_modalities": ["text"]}
    assert [x["name"] for x in models["models"]] == ["tiny-a"]  # llama-server's Ollama-style list
    body = {"messages": MSGS, "temperature": 1.0, "ignore_eos": True}
    _, a = flagged.request("POST", "/v1/chat/completions", body)
    _, b = flagged.request("POST", "/v1/chat/completions", body)
    assert a["usage"]["completion_tokens"] == 5  # -n 5 without max_tokens
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]  # --seed 42
    assert a["__verbose"]["generation_settings"]["seed"] == 42 and a["__verbose"]["stop"] is True
    assert a["model"] == "tiny-a"


@pytest.mark.parametrize("path", ["/infill", "/embedding", "/embeddings", "/v1/embeddings", "/rerank",
                                  "/reranking", "/v1/rerank", "/v1/reranking", "/v1/audio/transcriptions",
                                  "/audio/transcriptions"])
def test_routes_for_other_model_kinds_answer_501(server, path):
    """llama-server answers these with 501 not_supported_error for a model without the ability
    (no FIM tokens, no --embeddings / --reranking); so do we, saying why, rather than 404."""
    status, err = server.request("POST", path, {"content": "a", "input": "a", "query": "a", "documents": ["b"],
                                                "input_prefix": "a", "input_suffix": "b"})
    assert status == 501 and err["error"]["type"] == "not_supported_error", err
    assert "gpt-oss" in err["error"]["message"]


def test_flags_no_slots_and_context_shift(flagged):
    status, err = flagged.request("GET", "/slots")
    assert status == 501 and err["error"]["type"] == "not_supported_error"
    assert "context shift is not supported" in flagged.log()


def test_flag_reasoning_off_skips_the_analysis_channel(flagged):
    flagged.script("Hi<|return|>", "Hi<|return|>")
    _, r = flagged.request("POST", "/v1/chat/completions", {
        "messages": MSGS, "max_tokens": 4, "reasoning_format": "none"})
    assert r["choices"][0]["message"]["content"] == "<|channel|>final<|message|>Hi"
    _, r = flagged.request("POST", "/v1/chat/completions", {
        "messages": MSGS, "max_tokens": 4, "reasoning_format": "none",
        "chat_template_kwargs": {"enable_thinking": True}})
    assert r["choices"][0]["message"]["content"] == "Hi"  # the request turned thinking back on


def test_flag_swa_full_keeps_old_prefixes(flagged, server):
    a = "one two three four five six " * 40
    b = a[: len(a) // 2] + "seven eight nine " * 20
    times = {}
    for name, srv in (("swa_full", flagged), ("ring", server)):
        key = None if srv is flagged else API_KEY
        body = {"max_tokens": 1, "temperature": 0}
        srv.request("POST", "/v1/completions", {"prompt": a, **body}, key=key)
        _, r = srv.request("POST", "/v1/completions", {"prompt": b, **body}, key=key)
        times[name] = r["timings"]["cache_n"]
    assert times["swa_full"] > 100 and times["ring"] == 0, times


def test_flag_cors_origins_restricts(flagged):
    def preflight(origin: str) -> str | None:
        host, port = flagged.base_url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("OPTIONS", "/v1/chat/completions", headers={"Origin": origin,
                                                                  "Access-Control-Request-Method": "POST"})
        r = conn.getresponse()
        r.read()
        return r.getheader("access-control-allow-origin")

    assert preflight("http://good.example") == "http://good.example"
    assert preflight("http://evil.com") is None


def test_flag_host_listens_on_both_addresses(flagged):
    port = int(flagged.base_url.rsplit(":", 1)[1])
    with urllib.request.urlopen(f"http://[::1]:{port}/health", timeout=10) as r:
        assert r.status == 200
    with socket.create_connection(("127.0.0.1", port), timeout=10):
        pass


def test_slots_fail_on_no_slot_when_all_busy(served_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "one-slot.log"
    srv = start_server(served_model, ["-np", "1", "-t", "1"], log, None)
    try:
        assert srv.request("GET", "/slots?fail_on_no_slot=1")[0] == 200
        with cf.ThreadPoolExecutor(1) as pool:
            busy = pool.submit(srv.request, "POST", "/completion", {"prompt": "x", "n_predict": 400, **GREEDY,
                                                                    "repeat_penalty": 1.1})
            deadline = time.monotonic() + 30
            status = 200
            while status == 200 and time.monotonic() < deadline and not busy.done():
                status, body = srv.request("GET", "/slots?fail_on_no_slot=1")
            assert status == 503 and body["error"]["type"] == "unavailable_error"
            _, (slot,) = srv.request("GET", "/slots")  # llama-server's fields for a busy slot
            assert slot["is_processing"] or busy.done()
            if slot["is_processing"]:
                nxt = slot["next_token"][0]
                assert nxt["has_next_token"] and nxt["n_remain"] + nxt["n_decoded"] == 400
                assert slot["params"]["n_predict"] == 400 and slot["params"]["temperature"] == 0
                assert slot["params"]["repeat_penalty"] == 1.1 and slot["params"]["samplers"][0] == "penalties"
                assert slot["n_prompt_tokens"] >= 1 and slot["speculative"] is False
            assert busy.result(timeout=120)[0] == 200
            _, (idle,) = srv.request("GET", "/slots")
            assert not idle["is_processing"] and idle["next_token"][0]["n_remain"] == -1
    finally:
        stop_server(srv)


def test_template_receives_llama_server_variables(served_model, tmp_path_factory):
    template = ("{% for m in messages %}{{ m['role'] }}={{ m['content'] }};{% endfor %}"
                "think={{ enable_thinking }};date={{ date_string }};x={{ x }};eos={{ eos_token }};"
                "effort={{ reasoning_effort if reasoning_effort is defined else '-' }}")
    log = tmp_path_factory.mktemp("logs") / "template.log"
    srv = start_server(served_model, ["-t", "1", "--chat-template", template, "--chat-template-kwargs",
                                      '{"x": "server"}'], log, None)
    try:
        _, r = srv.request("POST", "/apply-template", {"messages": [{"role": "user", "content": "hi"}]})
        p = r["prompt"]
        assert p.startswith("user=hi;think=True;date=") and ";x=server;" in p and ";eos=" in p
        assert time.strftime("%Y") in p
        _, r = srv.request("POST", "/apply-template", {"messages": [{"role": "user", "content": "hi"}],
                                                       "chat_template_kwargs": {"x": "request",
                                                                                "enable_thinking": False},
                                                       "reasoning_effort": "high"})
        assert "think=False" in r["prompt"] and "x=request" in r["prompt"] and "effort=high" in r["prompt"]
        status, err = srv.request("POST", "/apply-template", {"messages": [{"role": "user", "content": "hi"}],
                                                              "chat_template_kwargs": {"enable_thinking": "no"}})
        assert status == 400 and "enable_thinking" in err["error"]["message"]
    finally:
        stop_server(srv)
    log = tmp_path_factory.mktemp("logs") / "chatml.log"
    srv = start_server(served_model, ["-t", "1", "--chat-template", "chatml"], log, None)
    try:
        _, r = srv.request("POST", "/apply-template", {"messages": [{"role": "user", "content": "hi"}]})
        assert r["prompt"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    finally:
        stop_server(srv)


def test_reserved_template_kwargs_are_refused_not_a_crash(server):
    status, r = server.request("POST", "/apply-template", {
        "messages": MSGS, "chat_template_kwargs": {"messages": "x", "add_generation_prompt": False}})
    assert status == 400 and "chat_template_kwargs" in r["error"]["message"], r


def test_verbose_off_by_default_and_any_model_on_v1_completions(client):
    r = client.completions.create(model="whatever-name", prompt="Hi", max_tokens=1)
    assert r.model == "tiny-test" and "__verbose" not in (r.model_extra or {})


def test_the_end_token_is_listed_in_tokens_as_llama_server_does(server):
    _, tok = server.request("POST", "/tokenize", {"content": "<|return|>"})
    (ret,) = tok["tokens"]
    body = {"prompt": [10, 11, 12, 13], "n_predict": 5, "temperature": 0, "return_tokens": True,
            "logit_bias": [[ret, 1000]]}
    status, out = server.request("POST", "/completion", body)
    assert status == 200 and out["stop_type"] == "eos", out
    assert out["tokens"] == [ret] and out["content"] == "" and out["tokens_predicted"] == 1
    chunks = sse(server, "/completion", {**body, "stream": True})
    assert [c["tokens"] for c in chunks[:-1]] == [[ret]] and chunks[-1]["stop"] is True, chunks


def test_response_fields_pick_and_unnest(server):
    body = {"prompt": [10, 11, 12, 13], "n_predict": 2, "response_fields": ["content", "generation_settings/n_predict",
                                                                    "timings/prompt_n", "no/such"]}
    status, out = server.request("POST", "/completion", body)
    assert status == 200 and set(out) == {"content", "generation_settings/n_predict", "timings/prompt_n"}, out
    assert out["generation_settings/n_predict"] == 2 and out["timings/prompt_n"] >= 1


def test_chat_n_probs_temperature_above_two_and_props_post(server, client):
    """llama-server's readings: n_probs on a chat request turns logprobs on; a temperature above
    OpenAI's 2 is taken; POST /props (settings at run time) is 501 not_supported_error."""
    body = {"model": "tiny-test", "messages": MSGS, "max_tokens": 2, "n_probs": 3, "temperature": 3.5}
    status, out = server.request("POST", "/v1/chat/completions", body)
    assert status == 200, out
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and all(len(e["top_logprobs"]) == 3 for e in content)
    status, out = server.request("POST", "/props", {"n_ctx": 10})
    assert status == 501 and out["error"]["type"] == "not_supported_error", out


def test_lora_adapters_lists_none(server):
    assert server.request("GET", "/lora-adapters") == (200, [])
    assert server.request("POST", "/lora-adapters", []) == (200, {"success": True})
    status, out = server.request("POST", "/lora-adapters", [{"id": 0, "scale": 1.0}])
    assert status == 400 and "no LoRA adapter" in out["error"]["message"], out
    status, out = server.request("POST", "/lora-adapters", {"id": 0})
    assert status == 400, out


def test_flags_set_the_sampling_defaults(flagged):
    """--samplers, -l/--logit-bias, --repeat-penalty, --dry-*: the defaults of requests that send
    none (a request's own logit_bias replaces the flag's, as in llama-server)."""
    params = flagged.request("GET", "/props")[1]["default_generation_settings"]["params"]
    assert params["samplers"] == ["top_k", "temperature"] and params["repeat_penalty"] == 1.3
    assert params["dry_multiplier"] == 0.5 and params["dry_sequence_breakers"] == ["@"]
    body = {"prompt": [10, 11, 12], "n_predict": 2, "temperature": 0, "return_tokens": True}
    status, out = flagged.request("POST", "/completion", body)
    assert status == 200 and out["tokens"] == [77, 77], out  # +1000 wins over every penalty
    assert out["generation_settings"]["logit_bias"] == [{"bias": 1000.0, "token": 77}]
    status, out = flagged.request("POST", "/completion", {**body, "logit_bias": []})
    assert status == 200 and 77 not in out["tokens"] and out["generation_settings"]["logit_bias"] == [], out


def test_id_slot_picks_the_slot(server):
    for slot in (2, 0, 3):
        status, out = server.request("POST", "/completion", {"prompt": "Hello", "n_predict": 2, "id_slot": slot})
        assert status == 200 and out["id_slot"] == slot, out
    status, out = server.request("POST", "/completion", {"prompt": "Hello", "n_predict": 2, "id_slot": 4})
    assert status == 400 and out["error"]["param"] == "id_slot", out


def test_timings_per_token_in_streams(server):
    body = {"prompt": [10, 11, 12], "n_predict": 4, "stream": True, "timings_per_token": True, **GREEDY}
    chunks = [c for c in sse(server, "/completion", body) if not c.get("stop")]
    assert [c["timings"]["predicted_n"] for c in chunks] == [1, 2, 3, 4], chunks
    assert all("timings" not in c for c in sse(server, "/completion", {**body, "timings_per_token": False})[:-1])
    chat = {"messages": MSGS, "max_tokens": 4, "stream": True, "timings_per_token": True, **GREEDY}
    deltas = [c for c in sse(server, "/v1/chat/completions", chat)[1:]  # after the role chunk, sent first
              if c != "[DONE]" and c["choices"] and c["choices"][0]["finish_reason"] is None]
    assert deltas and all(c["timings"]["predicted_n"] >= 1 for c in deltas), deltas


@pytest.mark.parametrize("n_indent,content", [
    (4, "a\n    b\n  "),  # the third line has 2 spaces: cut where its text starts
    (2, "a\n    b\n  c\n"),
    (0, "a\n    b\n  c\nd"),
])
def test_n_indent_ends_the_reply_at_a_line_indented_less(server, n_indent, content):
    """llama-server's n_indent: every line after the first needs that much leading whitespace;
    the first that has less ends the reply ("limit") with its text cut off."""
    grammar = 'root ::= "a\\n    b\\n  c\\nd"'
    status, body = server.request("POST", "/completion", {"prompt": "x", "grammar": grammar, "n_indent": n_indent,
                                                          "temperature": 0, "n_predict": 40})
    assert status == 200, body
    assert body["content"] == content
    assert body["stop_type"] == ("limit" if n_indent else "eos")


def test_get_on_a_slot_is_not_found(server):
    status, body = server.request("GET", "/slots/0")
    assert status == 404 and body["error"]["type"] == "not_found_error"


def test_pinged_streams_parse_as_before(client, server):
    """sse_ping_interval per request: with pings in every pause, the SDK's stream reads the same."""
    kw = dict(model="tiny-test", messages=MSGS, max_tokens=24, temperature=0)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    chunks = client.chat.completions.create(**kw, stream=True, extra_body={"sse_ping_interval": 0.0005})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain
    body = {"prompt": "Hello", "n_predict": 8, **GREEDY}
    _, full = server.request("POST", "/completion", body)
    events = sse(server, "/completion", {**body, "stream": True, "sse_ping_interval": 0.0005})
    assert "".join(e["content"] for e in events[:-1]) == full["content"] and events[-1]["stop"] is True
