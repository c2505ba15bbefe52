"""llama-server behaviours that differed (issue 35, item 7), each checked by sending the request
llama-server was checked with to `hybridmoe serve` on the demo model. With $HYBRIDMOE_LLAMA_SERVER
set the same request also goes to llama-server, and where we behave alike the answers are compared;
where we differ on purpose (docs/server.md, "Differences from llama-server") only ours is checked.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridmoe.tokenizer.builtin_templates import resolve_chat_template
from hybridmoe.tokenizer.chat_template import render_chat
from hybridmoe.tokenizer.llama_templates import LLAMA_CPP_TEMPLATES
from tests.test_llama_server_interop import DEMO, LLAMA_SERVER, _post, llama, llama_server  # noqa: F401

from .conftest import ServerProcess, start_server, stop_server
from .test_llama_compat import sse

pytestmark = pytest.mark.skipif(not DEMO.exists(), reason="demo.gguf not built yet (see demo/README.md)")
HAVE_LLAMA = bool(LLAMA_SERVER and Path(LLAMA_SERVER).is_file())
needs_llama = pytest.mark.skipif(not HAVE_LLAMA, reason="no llama-server binary: set HYBRIDMOE_LLAMA_SERVER")

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
# What `llama-server --no-jinja --chat-template NAME` answers /apply-template with for CHAT.
LLAMA_SERVER_PROMPTS = {
    "llama3": "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user"
              "<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|><|start_header_id|>assistant"
              "<|end_header_id|>\n\n",
    "mistral-v7": "[SYSTEM_PROMPT] Be brief.[/SYSTEM_PROMPT][INST] Hi[/INST] Hello</s>[INST] Bye[/INST]",
    "gemma": "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
             "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n",
    "phi4": "<|im_start|>system<|im_sep|>Be brief.<|im_end|><|im_start|>user<|im_sep|>Hi<|im_end|><|im_start|>"
            "assistant<|im_sep|>Hello<|im_end|><|im_start|>user<|im_sep|>Bye<|im_end|><|im_start|>assistant<|im_sep|>",
    "zephyr": "<|system|>\nBe brief.<|endoftext|>\n<|user|>\nHi<|endoftext|>\n<|assistant|>\nHello<|endoftext|>\n"
              "<|user|>\nBye<|endoftext|>\n<|assistant|>\n",
    "vicuna": "Be brief.\n\nUSER: Hi\nASSISTANT: Hello</s>\nUSER: Bye\nASSISTANT:",
    "deepseek3": "Be brief.\n\n<｜User｜>Hi<｜Assistant｜>Hello<｜end▁of▁sentence｜><｜User｜>Bye<｜Assistant｜>",
    "command-r": "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>Be brief.<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|>"
                 "<|USER_TOKEN|>Hi<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hello"
                 "<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Bye<|END_OF_TURN_TOKEN|>"
                 "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
}
# Edge cases of llama.cpp's formats: untrimmed text, two systems, two assistants, content parts.
EDGES = [[{"role": "user", "content": " Hi there \n"}],
         [{"role": "system", "content": " S1 "}, {"role": "system", "content": "S2"}, {"role": "user", "content": "a"},
          {"role": "assistant", "content": " b "}, {"role": "assistant", "content": "c"},
          {"role": "user", "content": [{"type": "text", "text": "d"}, {"type": "text", "text": "e"}]}]]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """`hybridmoe serve` on the demo model with llama-server's test line (one slot, 2048 context)."""
    logs = tmp_path_factory.mktemp("demo")
    srv = start_server(str(DEMO), ["-t", "1", "-np", "1", "-c", "2048"], logs / "server.log", None)
    yield srv
    stop_server(srv)


@pytest.fixture
def reference(request: pytest.FixtureRequest) -> int | None:
    """llama-server's port (the interop tests' `llama` fixture), or None without a binary."""
    return request.getfixturevalue("llama") if HAVE_LLAMA else None


def post_both(demo: ServerProcess, reference: int | None, path: str, body: dict) -> tuple[tuple, tuple | None]:
    return demo.request("POST", path, body), (_post(reference, path, body) if reference else None)


# ---- (1) --chat-template NAME --------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(LLAMA_SERVER_PROMPTS))
def test_most_used_template_names_render_as_llama_server(name):
    assert render_chat(resolve_chat_template(name), CHAT, add_generation_prompt=True) == LLAMA_SERVER_PROMPTS[name]


@needs_llama
@pytest.mark.parametrize("name", sorted({*LLAMA_CPP_TEMPLATES, "chatml"}))
def test_every_served_template_name_renders_as_llama_server(name, tmp_path):
    """llama-server's built-in formats are written by `--no-jinja` (with Jinja on it renders the
    name itself); ours are the same strings whichever way."""
    with llama_server(tmp_path, "--no-jinja", "--chat-template", name) as port:
        for messages in [CHAT, *EDGES]:
            status, r = _post(port, "/apply-template", {"messages": messages})
            assert status == 200, r
            assert render_chat(resolve_chat_template(name), messages, add_generation_prompt=True) == r["prompt"]


def test_serve_takes_a_llama_server_template_name(tmp_path):
    srv = start_server(str(DEMO), ["-t", "1", "-np", "1", "-c", "2048", "--chat-template", "llama3"],
                       tmp_path / "llama3.log", None)
    try:
        status, r = srv.request("POST", "/apply-template", {"messages": CHAT})
        assert status == 200 and r["prompt"] == LLAMA_SERVER_PROMPTS["llama3"]
        status, r = srv.request("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "temperature": 0})
        assert status == 200 and r["usage"]["completion_tokens"] >= 1, r
        assert isinstance(r["choices"][0]["message"]["content"], str)  # plain format: no reasoning channel
    finally:
        stop_server(srv)


def test_template_names_not_built_in_are_refused_at_start(tmp_path):
    with pytest.raises(RuntimeError, match="'kimi-k2' is not built into hybridmoe.*--chat-template-file"):
        start_server(str(DEMO), ["-t", "1", "--chat-template", "kimi-k2"], tmp_path / "kimi.log", None)


# ---- (2) token-array and JSON prompts on /completion ---------------------------------------------

GREEDY = {"n_predict": 3, "temperature": 0}
PROMPTS = [  # (prompt, status, number of results: 0 for one object)
    ([1, 2, 3], 200, 0), ([[1, 2], [3]], 200, 2), (["text", [1, 2]], 200, 2), (["Hello", 1, 2], 200, 0),
    ({"prompt_string": "Hello"}, 200, 0), ({"prompt_string": [1, 2]}, 200, 0),
    ([{"prompt_string": "Hello"}, "Hi"], 200, 2), ([{"prompt_string": "Hello"}, [1, 2]], 200, 2),
    ({"prompt_string": "Hello", "multimodal_data": []}, 400, 0),
    ({"prompt_string": "Hello", "multimodal_data": None}, 400, 0), ({"foo": "x"}, 400, 0),
]
COMPARED = ("index", "content", "prompt", "tokens_evaluated", "tokens_predicted", "stop_type")


@pytest.mark.parametrize("prompt,status,results", PROMPTS, ids=[json.dumps(p[0]) for p in PROMPTS])
def test_native_prompt_shapes(demo, reference, prompt, status, results):
    (got_status, got), theirs = post_both(demo, reference, "/completion", {"prompt": prompt, **GREEDY})
    assert got_status == status, got
    if status == 200:
        assert isinstance(got, list) == bool(results) and (not results or len(got) == results)
    if theirs is None:
        return
    assert theirs[0] == got_status
    if status != 200:
        assert got["error"]["message"] == theirs[1]["error"]["message"]
        return
    ours, llamas = (got, theirs[1]) if results else ([got], [theirs[1]])
    assert [{k: r[k] for k in COMPARED} for r in ours] == [{k: r[k] for k in COMPARED} for r in llamas]


def test_one_empty_prompt_is_a_400(demo):
    """llama-server answers `[[]]` with an empty result (stop_type none); an empty prompt is a 400 here."""
    status, r = demo.request("POST", "/completion", {"prompt": [[]], **GREEDY})
    assert status == 400 and r["error"]["param"] == "prompt", r


# ---- (3) __verbose -------------------------------------------------------------------------------

VERBOSE = [("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0}),
           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                     "temperature": 0})]


@pytest.mark.parametrize("path,body", VERBOSE, ids=[p for p, _ in VERBOSE])
def test_request_verbose_adds_the_native_result(demo, reference, path, body):
    (status, r), theirs = post_both(demo, reference, path, {**body, "verbose": True})
    assert status == 200 and r["__verbose"]["tokens_predicted"] == 2 and "generation_settings" in r["__verbose"]
    assert "__verbose" not in demo.request("POST", path, body)[1]  # without it (and no --verbose): none
    if theirs is not None:
        assert set(r["__verbose"]) == set(theirs[1]["__verbose"])


def test_native_completion_has_no_verbose_field(demo, reference):
    """The native reply is already what __verbose would hold: neither server adds it."""
    (status, r), theirs = post_both(demo, reference, "/completion", {"prompt": "Hello", "verbose": True, **GREEDY})
    assert status == 200 and "__verbose" not in r
    assert theirs is None or "__verbose" not in theirs[1]


def test_streamed_completion_carries_verbose_on_its_last_chunk(demo):
    chunks = [c for c in sse(demo, "/v1/completions", {**VERBOSE[0][1], "verbose": True, "stream": True}, key=None)
              if c != "[DONE]"]
    assert [i for i, c in enumerate(chunks) if "__verbose" in c] == [len(chunks) - 1]
    assert chunks[-1]["__verbose"]["tokens_predicted"] == 2


# ---- (4) Anthropic /v1/messages ------------------------------------------------------------------

MESSAGE = {"model": "x", "max_tokens": 60, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}


def test_messages_without_thinking_show_reasoning_first(demo, reference):
    """No `thinking` asked for: gpt-oss reasons anyway, and both servers show it, before the text."""
    (status, r), theirs = post_both(demo, reference, "/v1/messages", MESSAGE)
    assert status == 200 and [b["type"] for b in r["content"]] == ["thinking", "text"], r
    if theirs is not None:
        assert [(b["type"], b.get("thinking", b.get("text"))) for b in r["content"]] == \
               [(b["type"], b.get("thinking", b.get("text"))) for b in theirs[1]["content"]]


def test_streamed_message_blocks_close_before_the_next_opens(demo):
    """llama-server opens the text block before closing the thinking one; Anthropic's stream (and
    ours) has one block open at a time."""
    status, raw = demo.request("POST", "/v1/messages", {**MESSAGE, "stream": True})  # `event:` + `data:` lines
    assert status == 200
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    order = [(e["type"], e["index"]) for e in events if e["type"] in ("content_block_start", "content_block_stop")]
    assert order == [("content_block_start", 0), ("content_block_stop", 0),
                     ("content_block_start", 1), ("content_block_stop", 1)]


def test_empty_messages_are_a_400(demo):
    """llama-server generates from the system prompt alone; Anthropic's API refuses, and so do we."""
    status, r = demo.request("POST", "/v1/messages", {**MESSAGE, "messages": []})
    assert status == 400 and r["type"] == "error" and "messages" in r["error"]["message"]


# ---- (5) /apply-template and assistant prefill ---------------------------------------------------

HI = [{"role": "user", "content": "Hi"}]
PREFILL = [*HI, {"role": "assistant", "content": "Hello"}]


def test_apply_template_without_generation_prompt_as_llama_server(demo, reference):
    (status, r), theirs = post_both(demo, reference, "/apply-template", {"messages": HI, "add_generation_prompt": False})
    assert status == 200 and r["prompt"].endswith("<|start|>user<|message|>Hi<|end|>")
    assert theirs is None or theirs == (status, r)


def test_prefill_continues_the_final_channel(demo):
    """A trailing assistant message is continued in the final channel. llama-server writes an empty
    analysis message before it and repeats the prefill in the reply's content; we write no analysis
    the client did not send and answer only what was generated (as vLLM and Anthropic do)."""
    status, rendered = demo.request("POST", "/apply-template", {"messages": PREFILL})
    assert status == 200 and rendered["prompt"].endswith("<|end|><|start|>assistant<|channel|>final<|message|>Hello")
    status, r = demo.request("POST", "/v1/chat/completions", {"messages": PREFILL, "max_tokens": 2, "temperature": 0})
    _, raw = demo.request("POST", "/completion", {"prompt": rendered["prompt"], "n_predict": 2, "temperature": 0})
    assert status == 200 and r["choices"][0]["message"]["content"] == raw["content"]


PREFILL_ERRORS = [
    {"messages": [*PREFILL, {"role": "assistant", "content": "Again"}]},
    {"messages": [*HI, {"role": "assistant", "content": "Hello", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}], "max_tokens": 4},
]


@pytest.mark.parametrize("body", PREFILL_ERRORS, ids=["two trailing assistants", "continue a tool call"])
def test_prefill_errors_as_llama_server(demo, reference, body):
    path = "/v1/chat/completions" if "max_tokens" in body else "/apply-template"
    (status, r), theirs = post_both(demo, reference, path, body)
    assert status == 400 and "cannot" in r["error"]["message"], r
    if theirs is not None:
        assert theirs[0] == 400 and theirs[1]["error"]["message"].rstrip(".").lower() in r["error"]["message"].lower()


def test_apply_template_with_no_messages_is_a_400(demo):
    """llama-server renders the system prompt and a generation prompt; a chat needs a message here."""
    status, r = demo.request("POST", "/apply-template", {"messages": []})
    assert status == 400 and r["error"]["param"] == "messages"


# ---- (6) CORS ------------------------------------------------------------------------------------

def raw(base_url: str, method: str, path: str, headers: dict[str, str], body: dict | None = None
        ) -> tuple[int, dict[str, str], str]:
    """One request: status, headers (lower-case names) and body text."""
    data = None if body is None else json.dumps(body).encode()
    hdrs = {**({"Content-Type": "application/json"} if body is not None else {}), **headers}
    req = urllib.request.Request(base_url + path, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read().decode()


def raw_both(demo: ServerProcess, reference: int | None, method: str, path: str, headers: dict[str, str],
             body: dict | None = None) -> tuple[tuple, tuple | None]:
    theirs = raw(f"http://127.0.0.1:{reference}", method, path, headers, body) if reference else None
    return raw(demo.base_url, method, path, headers, body), theirs


PREFLIGHT = {"Origin": "http://example.com", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
ECHOED = ("access-control-allow-origin", "access-control-allow-credentials", "access-control-allow-methods")


def test_preflight_as_llama_server(demo, reference):
    """Both echo the Origin, allow credentials and the same methods. llama-server's
    Allow-Headers is the configured `*`, which a browser does not let cover `Authorization` on a
    credentialed request; ours names the headers asked for."""
    (status, h, body), theirs = raw_both(demo, reference, "OPTIONS", "/v1/chat/completions", PREFLIGHT)
    assert status == 200 and body == ""
    assert [h.get(k) for k in ECHOED] == ["http://example.com", "true", "GET, POST, DELETE, OPTIONS"]
    assert h["access-control-allow-headers"] == "authorization, content-type"
    if theirs is not None:
        assert theirs[0] == 200 and [theirs[1].get(k) for k in ECHOED] == [h.get(k) for k in ECHOED]
        assert theirs[1]["access-control-allow-headers"] == "*"


def test_options_without_origin_is_a_200(demo, reference):
    """Not a CORS preflight: llama-server answers every OPTIONS with a 200 (and an empty
    Allow-Origin); so do we, with `Allow` and no CORS headers."""
    (status, h, body), theirs = raw_both(demo, reference, "OPTIONS", "/v1/chat/completions", {})
    assert status == 200 and body == "" and h["allow"] == "GET, POST, DELETE, OPTIONS"
    assert "access-control-allow-origin" not in h
    assert theirs is None or theirs[0] == 200


def test_cross_origin_response_headers(demo, reference):
    """A request with an Origin gets it echoed on the response by both. Ours also sends
    `Allow-Credentials` (and `Vary: Origin`): a credentialed fetch needs it on the response, not
    only on the preflight, and llama-server leaves it off."""
    (status, h, _), theirs = raw_both(demo, reference, "GET", "/health", {"Origin": "http://example.com"})
    assert status == 200 and h["access-control-allow-origin"] == "http://example.com"
    assert h["access-control-allow-credentials"] == "true" and h["vary"] == "Origin"
    if theirs is not None:
        assert theirs[1]["access-control-allow-origin"] == "http://example.com"
        assert "access-control-allow-credentials" not in theirs[1]


@needs_llama
def test_llama_server_tools_limit_cors_to_localhost(tmp_path):
    """`--tools` (llama-server's built-in file and shell tools) makes its default origin
    `localhost`. Here `--tools` is set aside with a warning (there are no server-side tools), so
    nothing is exposed and `--cors-origins` keeps its default: the same request is echoed."""
    with llama_server(tmp_path, "--jinja", "--tools", "all") as port:
        for origin, echoed in [("http://example.com", None), ("http://localhost:3000", "http://localhost:3000")]:
            _, h, _ = raw(f"http://127.0.0.1:{port}", "OPTIONS", "/v1/chat/completions",
                          {**PREFLIGHT, "Origin": origin})
            assert h.get("access-control-allow-origin") == echoed


def test_tools_flag_leaves_cors_as_configured(tmp_path):
    srv = start_server(str(DEMO), ["-t", "1", "-np", "1", "-c", "2048", "--tools", "all"], tmp_path / "tools.log", None)
    try:
        status, h, _ = raw(srv.base_url, "OPTIONS", "/v1/chat/completions", PREFLIGHT)
        assert status == 200 and h["access-control-allow-origin"] == "http://example.com"
    finally:
        stop_server(srv)


# ---- (7) /metrics --------------------------------------------------------------------------------

TWO_COMPLETIONS = [{"prompt": "Hello there", "n_predict": 16, "temperature": 0}] * 2


def scrape(base_url: str) -> tuple[dict[str, str], dict[str, float]]:
    status, h, text = raw(base_url, "GET", "/metrics", {})
    assert status == 200, text
    return h, {k: float(v) for k, v in (line.split() for line in text.splitlines() if line.startswith("llamacpp:"))}


def check_metrics(base_url: str) -> None:
    """After two 16-token completions: llama-server's headers; rates since the last scrape, the
    generation rate without each request's first token (sampled by the prompt step, so outside
    the decode time); the native timings likewise."""
    for body in TWO_COMPLETIONS:
        status, _, text = raw(base_url, "POST", "/completion", {}, body)
        t = json.loads(text)["timings"]
        assert status == 200 and t["predicted_n"] == 16
        assert t["predicted_per_second"] == pytest.approx(15e3 / t["predicted_ms"], rel=1e-3)
        assert t["predicted_per_token_ms"] == pytest.approx(t["predicted_ms"] / 15, rel=1e-3)
    h, m = scrape(base_url)
    assert h["content-type"] == "text/plain; version=0.0.4" and h["process-start-time-unix"].isdigit()
    assert m["llamacpp:tokens_predicted_total"] == 32
    assert m["llamacpp:predicted_tokens_seconds"] == pytest.approx(30 / m["llamacpp:tokens_predicted_seconds_total"],
                                                                   rel=1e-3)
    assert m["llamacpp:prompt_tokens_seconds"] == pytest.approx(
        m["llamacpp:prompt_tokens_total"] / m["llamacpp:prompt_seconds_total"], rel=1e-3)
    _, again = scrape(base_url)  # nothing ran since: a new window, no rate
    assert again["llamacpp:predicted_tokens_seconds"] == 0 and again["llamacpp:prompt_tokens_seconds"] == 0


def test_metrics_as_llama_server(tmp_path):
    srv = start_server(str(DEMO), ["-t", "1", "-np", "1", "-c", "2048", "--metrics"], tmp_path / "metrics.log", None)
    try:
        check_metrics(srv.base_url)
    finally:
        stop_server(srv)
    if HAVE_LLAMA:
        with llama_server(tmp_path, "--jinja", "--metrics") as port:
            check_metrics(f"http://127.0.0.1:{port}")


# ---- (8) logprobs and logit_bias while the model reasons -----------------------------------------

REASON = {"messages": HI, "max_tokens": 40, "temperature": 0}


def test_logprobs_cover_the_reasoning(demo, reference):
    """Both servers give a logprob for every generated token, the harmony header and analysis
    channel included (40 tokens, all reasoning here). Streamed, ours gives the same list;
    llama-server's stream drops those of the header tokens after `<|channel|>` (they make no delta)."""
    body = {**REASON, "logprobs": True, "top_logprobs": 1}
    (status, r), theirs = post_both(demo, reference, "/v1/chat/completions", body)
    choice = r["choices"][0]
    tokens = [t["token"] for t in choice["logprobs"]["content"]]
    assert status == 200 and len(tokens) == r["usage"]["completion_tokens"] == 40
    assert tokens[:2] == ["<|channel|>", "an"] and choice["message"]["reasoning_content"] in "".join(tokens)
    chunks = [c for c in sse(demo, "/v1/chat/completions", {**body, "stream": True}, key=None) if c != "[DONE]"]
    streamed = [t["token"] for c in chunks for ch in c["choices"]
                for t in (ch.get("logprobs") or {}).get("content") or []]
    assert streamed == tokens
    if theirs is not None:
        assert theirs[0] == 200 and [t["token"] for t in theirs[1]["choices"][0]["logprobs"]["content"]] == tokens


def test_logit_bias_applies_to_reasoning_tokens(demo, reference):
    """The reasoning starts with "The" (token 514) unbiased; banned, both servers reason otherwise."""
    status, plain = demo.request("POST", "/v1/chat/completions", REASON)
    assert status == 200 and plain["choices"][0]["message"]["reasoning_content"].startswith("The")
    (status, r), theirs = post_both(demo, reference, "/v1/chat/completions", {**REASON, "logit_bias": {"514": -100}})
    msg = r["choices"][0]["message"]
    assert status == 200 and not msg["reasoning_content"].startswith("The")
    if theirs is not None:
        assert theirs[1]["choices"][0]["message"] == msg
