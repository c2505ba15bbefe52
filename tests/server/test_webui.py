"""The chat page at `/`: what is public, and the page itself in a real headless Chromium.

The browser tests drive Debian's Chromium through Playwright against real `hybridmoe serve`
processes. Replies the demo model cannot give on demand (reasoning, tool calls, hostile Markdown,
an endless stream to stop) come from scripted streams that the test puts in the browser.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import ServerProcess, start_server, stop_server

CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ASSETS = {"/webui/app.js": "text/javascript", "/webui/markdown.js": "text/javascript",
          "/webui/style.css": "text/css"}
DEMO_KEY = "demo-secret"
WAIT_MS = 60_000


# ---- public and guarded routes (no browser) ---------------------------------------------------------

def test_page_is_public_and_leaks_nothing(server: ServerProcess):
    status, page = server.request("GET", "/", key=None)
    assert status == 200 and "<title>hybridmoe chat</title>" in page
    # The page is the same for everyone: no model name, path or setting of this server in it.
    assert "tiny" not in page.lower() and "gguf" not in page.lower()
    for path in ASSETS:
        status, body = server.request("GET", path, key=None)
        assert status == 200 and body, path
    with urllib.request.urlopen(server.base_url + "/") as r:
        headers = r.headers
    csp = headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "default-src 'none'" in csp
    assert headers["X-Content-Type-Options"] == "nosniff"
    for path, ctype in ASSETS.items():
        with urllib.request.urlopen(server.base_url + path) as r:
            assert r.headers["Content-Type"].startswith(ctype), path


@pytest.mark.parametrize("method,path", [("GET", "/props"), ("GET", "/slots"), ("GET", "/webui/other.js"),
                                         ("POST", "/v1/chat/completions"), ("GET", "/index.html/x")])
def test_everything_else_still_needs_the_key(server: ServerProcess, method: str, path: str):
    body = {"messages": [{"role": "user", "content": "hi"}]} if method == "POST" else None
    status, err = server.request(method, path, body, key=None)
    assert status == 401 and err["error"]["code"] == "invalid_api_key"


# ---- the page in a real browser -----------------------------------------------------------------------

def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("Chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)")
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    executable = _chromium()
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (the [test] extra) not installed")
    with sync_api.sync_playwright() as pw:
        # Playwright gives each launch a fresh temporary profile (--user-data-dir) and never
        # downloads a browser of its own when given the executable.
        b = pw.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_FLAGS)
        yield b
        b.close()


@pytest.fixture
def page(browser) -> Iterator[object]:
    context = browser.new_context(viewport={"width": 1280, "height": 960})
    pg = context.new_page()
    pg.set_default_timeout(WAIT_MS)
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.on("dialog", lambda d: (errors.append(f"unexpected {d.type} dialog: {d.message}"), d.dismiss()))
    yield pg
    context.close()
    assert not errors, errors


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The bundled demo model (writes English-looking text) behind an API key."""
    from hybridmoe.engine.llm import DEMO_MODEL

    if not Path(DEMO_MODEL).exists():
        pytest.skip(f"demo model not bundled at {DEMO_MODEL}")
    log_path = tmp_path_factory.mktemp("webui") / "demo-server.log"
    srv = start_server(str(DEMO_MODEL), ["--api-key", DEMO_KEY, "-t", "1", "-np", "2"], log_path, DEMO_KEY)
    yield srv
    stop_server(srv)


def screenshot_path(tmp_path: Path, name: str) -> Path:
    """Where screenshots go: $HYBRIDMOE_SCREENSHOT_DIR when set (to keep them), else the test's tmp dir."""
    folder = Path(os.environ.get("HYBRIDMOE_SCREENSHOT_DIR") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def open_with_key(page, srv: ServerProcess) -> None:
    """Opens the page with the key already kept in the browser (as after a first visit)."""
    page.goto(srv.base_url + "/")
    page.evaluate("key => localStorage.setItem('hybridmoe.apiKey', key)", srv.api_key)
    page.reload()
    page.wait_for_selector("#server-status.ok")


def send(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def words(text: str) -> list[str]:
    return re.sub(r"[^\w\s]", " ", text).split()


def stored_conversations(page) -> list[dict]:
    return page.evaluate("JSON.parse(localStorage.getItem('hybridmoe.conversations'))")


def test_chat_with_the_demo_model(page, demo_server: ServerProcess, tmp_path: Path):
    page.goto(demo_server.base_url + "/")
    # No key yet: /props answers 401, the page asks, and shows nothing of the server meanwhile.
    page.wait_for_selector("#key-dialog[open]")
    assert page.text_content("#model-name") == ""
    page.fill("#key-input", "wrong-key")
    page.click("#key-save")
    page.wait_for_selector("#key-dialog[open] #key-reason:has-text('refused')")
    page.fill("#key-input", DEMO_KEY)
    page.click("#key-save")
    page.wait_for_selector("#server-status.ok")
    assert page.text_content("#model-name") == "demo.gguf"

    page.click("#open-settings")
    page.fill("#set-system", "Answer in one sentence.")
    page.fill("#set-temperature", "0")
    page.fill("#set-top-p", "0.9")
    page.fill("#set-top-k", "20")
    page.fill("#set-min-p", "0.1")
    page.fill("#set-repeat-penalty", "1.1")
    page.fill("#set-max-tokens", "48")
    page.select_option("#set-reasoning-effort", "low")
    page.fill("#set-reasoning-budget", "6")
    page.click("#settings-save")

    sent: list[dict] = []
    page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
    send(page, "Who was David?")
    meta = page.wait_for_selector(".msg.assistant .msg-meta:has-text('tok/s')").text_content()
    assert sent == [{"messages": [{"role": "system", "content": "Answer in one sentence."},
                                  {"role": "user", "content": "Who was David?"}],
                     "stream": True, "stream_options": {"include_usage": True},
                     "temperature": 0, "top_p": 0.9, "top_k": 20, "min_p": 0.1, "repeat_penalty": 1.1,
                     "max_tokens": 48, "reasoning_effort": "low", "reasoning_budget_tokens": 6,
                     "reasoning_control": True, "return_progress": True}]
    assert page.is_visible("#send") and not page.is_visible("#stop")
    m = re.search(r"(\d+) tokens · (\d+\.\d) tok/s · prompt (\d+) tokens", meta)
    assert m and float(m.group(2)) > 0, meta

    [conv] = stored_conversations(page)
    assert conv["title"] == "Who was David?"
    user, reply = conv["messages"]
    assert user == {"role": "user", "content": "Who was David?"}
    assert reply["content"].strip() and not reply.get("error") and not reply.get("stopped")

    # The same request straight to the API (greedy, same settings): the page streamed exactly it.
    status, direct = demo_server.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "system", "content": "Answer in one sentence."},
                     {"role": "user", "content": "Who was David?"}],
        "temperature": 0, "top_p": 0.9, "top_k": 20, "min_p": 0.1, "repeat_penalty": 1.1, "max_tokens": 48,
        "reasoning_effort": "low", "reasoning_budget_tokens": 6})
    assert status == 200, direct
    assert reply["content"] == direct["choices"][0]["message"]["content"]
    assert reply.get("reasoning", "") == direct["choices"][0]["message"].get("reasoning_content", "")
    assert int(m.group(1)) == direct["usage"]["completion_tokens"]
    assert int(m.group(3)) == direct["usage"]["prompt_tokens"]
    # What the page shows is the reply's words (Markdown may drop marks, or add a code block's label).
    shown = words(page.inner_text(".msg.assistant .content"))
    assert shown and set(shown) <= set(words(reply["content"])) | {"image", "Copy", "text"}

    page.screenshot(path=screenshot_path(tmp_path, "webui-demo-chat.png"))

    # Reload: the conversation comes back from the browser's storage, and the key is not asked again.
    page.reload()
    page.wait_for_selector("#server-status.ok")
    assert not page.is_visible("#key-dialog")
    assert page.inner_text("#conversations li.active").strip().startswith("Who was David?")
    assert page.locator(".msg").count() == 2
    page.click("#new-chat")
    assert page.locator(".msg").count() == 0
    page.click("#conversations .conv-open")
    assert page.locator(".msg").count() == 2
    page.click("#conversations .conv-delete")
    assert page.locator("#conversations li").count() == 0 and stored_conversations(page) == []


@pytest.fixture(scope="module")
def prefixed_demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The demo model under --api-prefix /chat (as behind a reverse proxy's path)."""
    from hybridmoe.engine.llm import DEMO_MODEL

    if not Path(DEMO_MODEL).exists():
        pytest.skip(f"demo model not bundled at {DEMO_MODEL}")
    log_path = tmp_path_factory.mktemp("webui-prefix") / "demo-server.log"
    srv = start_server(str(DEMO_MODEL), ["--api-key", DEMO_KEY, "-t", "1", "-np", "1", "--api-prefix", "/chat"],
                       log_path, DEMO_KEY, prefix="/chat")
    yield srv
    stop_server(srv)


def test_the_page_works_under_an_api_prefix(page, prefixed_demo_server: ServerProcess):
    urls: list[str] = []
    page.on("request", lambda r: urls.append(r.url))
    open_with_key(page, prefixed_demo_server)  # the page at /chat/
    assert page.text_content("#model-name") == "demo.gguf"
    send(page, "Who was David?")
    page.wait_for_selector(".msg.assistant .msg-meta:has-text('tok/s')")
    assert page.inner_text(".msg.assistant .content").strip()
    paths = {u.removeprefix(prefixed_demo_server.base_url.removesuffix("/chat")) for u in urls}
    assert {"/chat/webui/app.js", "/chat/webui/markdown.js", "/chat/props", "/chat/v1/chat/completions"} <= paths
    assert all(p.startswith("/chat/") for p in paths), paths


def sse(*chunks: dict | str) -> str:
    return "".join(f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n" for c in chunks)


HOSTILE_MARKDOWN = (
    "# Answer\n\nHere is `inline <b>code</b>` and <img src=x onerror=alert(1)> as text.\n\n"
    "```python\nprint('<script>alert(2)</script>')\n```\n\n"
    "- **one**\n- *two*\n\n"
    "[bad](javascript:alert(3)) and [good](https://example.com/docs)"
)


def scripted_reply() -> str:
    def chunk(delta: dict, finish: str | None = None, **extra: object) -> dict:
        return {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": "demo.gguf",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}

    content = [HOSTILE_MARKDOWN[i:i + 7] for i in range(0, len(HOSTILE_MARKDOWN), 7)]
    return sse(
        chunk({"role": "assistant", "content": None}),
        chunk({"reasoning_content": "The user asks about "}),
        chunk({"reasoning_content": "**weather**; <img src=y onerror=alert(4)> call a tool."}),
        *[chunk({"content": part}) for part in content],
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
        chunk({}, "tool_calls", timings={"prompt_n": 31, "prompt_per_second": 250.0,
                                         "predicted_n": 57, "predicted_per_second": 12.5}),
        {"id": "chatcmpl-x", "object": "chat.completion.chunk", "choices": [],
         "usage": {"prompt_tokens": 31, "completion_tokens": 57, "total_tokens": 88}},
        "[DONE]",
    )


def test_reasoning_tool_calls_and_markdown_render_safely(page, demo_server: ServerProcess, tmp_path: Path):
    open_with_key(page, demo_server)
    send(page, "Who was David?")  # a real reply first, so the picture shows both kinds
    page.wait_for_selector(".msg.assistant .msg-meta:has-text('tok/s')")

    seen: list[dict] = []

    def scripted(route) -> None:
        req = route.request
        seen.append({"auth": req.headers.get("authorization"), "body": req.post_data_json})
        route.fulfill(status=200, body=scripted_reply(), headers={"Content-Type": "text/event-stream"})

    page.route("**/v1/chat/completions", scripted)
    send(page, "What is the weather in Paris?")
    reply = page.locator(".msg.assistant").nth(1)
    reply.locator(".msg-meta:has-text('tok/s')").wait_for()

    # The request: key, history (the first reply included), stream with usage.
    [req] = seen
    assert req["auth"] == f"Bearer {DEMO_KEY}"
    body = req["body"]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]

    # Reasoning: its own block, collapsed once the answer came, Markdown-rendered, opens on click.
    details = reply.locator("details.reasoning")
    assert details.is_visible() and details.get_attribute("open") is None
    assert details.locator("summary").inner_text() == "Reasoning"
    details.locator("summary").click()
    assert details.get_attribute("open") is not None
    assert details.locator(".reasoning-body strong").inner_text() == "weather"
    assert "<img src=y onerror=alert(4)>" in details.locator(".reasoning-body").inner_text()

    # Markdown: rendered structure, and every bit of HTML in the model's text shown as text.
    content = reply.locator(".content")
    assert content.locator("h1").inner_text() == "Answer"
    assert content.locator("p code").first.inner_text() == "inline <b>code</b>"
    assert "<img src=x onerror=alert(1)> as text." in content.inner_text()
    assert content.locator("pre code").inner_text() == "print('<script>alert(2)</script>')"
    assert content.locator(".code-lang").inner_text() == "python"
    assert content.locator("li strong").inner_text() == "one" and content.locator("li em").inner_text() == "two"
    assert page.locator("#messages img, #messages script, #messages b, #messages [onerror]").count() == 0
    assert content.locator("a").count() == 1
    good = content.locator("a")
    assert good.get_attribute("href") == "https://example.com/docs" and "noopener" in good.get_attribute("rel")
    assert content.locator(".md-unsafe-link").inner_text() == "bad"

    # Tool call: name and pretty-printed arguments; tokens/s from the stream's timings.
    assert reply.locator(".tool-call-name").inner_text() == "get_weather"
    assert json.loads(reply.locator(".tool-call-args").inner_text()) == {"city": "Paris"}
    meta = reply.locator(".msg-meta").inner_text()
    assert "57 tokens · 12.5 tok/s" in meta and "prompt 31 tokens · 250.0 tok/s" in meta
    assert "finish: tool_calls" in meta

    stored = stored_conversations(page)[0]["messages"][3]
    assert stored["content"] == HOSTILE_MARKDOWN and stored["toolCalls"][0]["name"] == "get_weather"
    assert stored["reasoning"].startswith("The user asks about **weather**")

    shot = screenshot_path(tmp_path, "webui-chat.png")
    page.screenshot(path=shot)
    assert shot.stat().st_size > 10_000


# A stream that sends a delta every 50 ms until the page aborts it: the demo model ends its
# replies in a few tokens, too soon to press Stop. Installed in the browser by this test only.
ENDLESS_STREAM = """
(() => {
  const realFetch = window.fetch;
  window.__streamAborted = false;
  window.fetch = (url, init = {}) => {
    if (!String(url).endsWith('v1/chat/completions')) return realFetch(url, init);
    const enc = new TextEncoder();
    let timer;
    const body = new ReadableStream({
      start(ctrl) {
        let n = 0;
        timer = setInterval(() => {
          const delta = {content: `word${n++} `};
          ctrl.enqueue(enc.encode(`data: ${JSON.stringify({choices: [{index: 0, delta}]})}\\n\\n`));
        }, 50);
        init.signal.addEventListener('abort', () => {
          clearInterval(timer);
          window.__streamAborted = true;
          ctrl.error(new DOMException('The user aborted a request.', 'AbortError'));
        });
      },
      cancel() { clearInterval(timer); },
    });
    return Promise.resolve(new Response(body, {status: 200, headers: {'Content-Type': 'text/event-stream'}}));
  };
})();
"""


def test_stop_button_ends_a_streaming_reply(page, demo_server: ServerProcess):
    page.add_init_script(ENDLESS_STREAM)
    open_with_key(page, demo_server)
    send(page, "Count forever")
    page.wait_for_selector(".msg.assistant .content:has-text('word3')")
    assert page.is_visible("#stop") and not page.is_visible("#send")
    assert page.inner_text(".msg.assistant .msg-meta") == "generating…"
    page.click("#stop")
    page.wait_for_selector(".msg.assistant .msg-meta:has-text('stopped')")
    assert page.evaluate("window.__streamAborted") is True
    assert page.is_visible("#send") and not page.is_visible("#stop")
    shown = page.inner_text(".msg.assistant .content")
    stored = stored_conversations(page)[0]["messages"][1]
    assert stored["stopped"] is True and "streaming" not in stored
    assert stored["content"].split() == shown.split() and len(shown.split()) >= 4
    assert page.is_enabled("#input")


# A stream that thinks (a reasoning delta every 50 ms) until the page asks, through the control
# endpoint, to end the thinking; then it answers. Both calls are answered in the browser.
THINKING_STREAM = """
(() => {
  const realFetch = window.fetch;
  window.__controls = [];
  let answering = false;
  window.fetch = (url, init = {}) => {
    const u = String(url);
    if (u.endsWith('v1/chat/completions/control')) {
      window.__controls.push(JSON.parse(init.body));
      answering = true;
      return Promise.resolve(new Response('{"success": true}', {status: 200}));
    }
    if (!u.endsWith('v1/chat/completions')) return realFetch(url, init);
    window.__sent = JSON.parse(init.body);
    const enc = new TextEncoder();
    let n = 0, timer;
    const body = new ReadableStream({
      start(ctrl) {
        const chunk = (delta, finish) => ctrl.enqueue(enc.encode(`data: ${JSON.stringify(
          {id: 'chatcmpl-ui', choices: [{index: 0, delta, finish_reason: finish || null}]})}\\n\\n`));
        ctrl.enqueue(enc.encode(`data: ${JSON.stringify({id: 'chatcmpl-ui', choices: [{index: 0, delta: {}}],
          prompt_progress: {total: 900, cache: 600, processed: 750, time_ms: 10}})}\\n\\n`));
        const think = () => {  // once the test has seen the progress (window.__go)
          if (!window.__go) { timer = setTimeout(think, 20); return; }
          if (!answering) { chunk({reasoning_content: `step${n++} `}); timer = setTimeout(think, 50); return; }
          chunk({content: 'The answer.'}, 'stop');
          ctrl.enqueue(enc.encode('data: [DONE]\\n\\n'));
          ctrl.close();
        };
        think();
      },
      cancel() { clearTimeout(timer); },
    });
    return Promise.resolve(new Response(body, {status: 200, headers: {'Content-Type': 'text/event-stream'}}));
  };
})();
"""


def test_answer_now_ends_the_thinking(page, demo_server: ServerProcess):
    page.add_init_script(THINKING_STREAM)
    open_with_key(page, demo_server)
    assert not page.is_visible("#answer-now")
    send(page, "Think it over")
    # before the first token: how far the prompt has been read
    page.wait_for_selector(".msg.assistant .msg-meta:has-text('reading the prompt: 750 / 900 tokens (600 reused)')")
    page.evaluate("window.__go = true")
    page.wait_for_selector(".msg.assistant .reasoning-body:has-text('step3')")
    assert page.inner_text(".msg.assistant .msg-meta") == "generating…"
    assert page.is_visible("#answer-now") and page.is_visible("#stop")
    page.click("#answer-now")
    page.wait_for_selector(".msg.assistant .content:has-text('The answer.')")
    assert page.evaluate("window.__controls") == [{"id": "chatcmpl-ui", "action": "reasoning_end"}]
    assert page.evaluate("window.__sent")["reasoning_control"] is True
    assert not page.is_visible("#answer-now") and page.is_visible("#send")


def test_regenerate_and_edit(page, demo_server: ServerProcess):
    """Regenerate asks again with the same conversation (greedy: the same reply); Edit takes a
    message back into the box and drops it and what follows."""
    open_with_key(page, demo_server)
    page.evaluate("localStorage.setItem('hybridmoe.settings', JSON.stringify({temperature: '0', max_tokens: '24'}))")
    page.reload()
    page.wait_for_selector("#server-status.ok")
    sent: list[dict] = []
    page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
    send(page, "Who was David?")
    page.wait_for_selector(".msg.assistant .msg-meta:has-text('tok/s')")
    first = stored_conversations(page)[0]["messages"][1]["content"]
    assert page.locator(".msg-regenerate").count() == 1 and page.locator(".msg-edit").count() == 1
    page.click(".msg-regenerate")
    page.wait_for_selector(".msg.assistant .msg-meta:has-text('tok/s')")
    page.wait_for_selector(".msg-regenerate")
    # the same prompt again: all of it but the last token comes from the slot
    assert re.search(r"prompt 1 tokens · .* · \d+ reused", page.inner_text(".msg.assistant .msg-meta"))
    [conv] = stored_conversations(page)
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant"]
    assert conv["messages"][1]["content"] == first  # temperature 0
    assert len(sent) == 2 and sent[0] == sent[1]  # the same conversation asked again
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.click(".msg-copy")
    page.wait_for_selector(".msg-copy:has-text('Copied')")
    assert page.evaluate("navigator.clipboard.readText()") == first
    page.click(".msg-edit")
    assert page.input_value("#input") == "Who was David?"
    assert page.locator(".msg").count() == 0 and stored_conversations(page)[0]["messages"] == []
    page.fill("#input", "Who was Solomon?")
    page.press("#input", "Enter")
    page.wait_for_selector(".msg.assistant .msg-meta:has-text('tok/s')")
    assert sent[2]["messages"] == [{"role": "user", "content": "Who was Solomon?"}]
    assert [m["content"] for m in stored_conversations(page)[0]["messages"]][:1] == ["Who was Solomon?"]


def test_server_ui_config_gives_the_page_its_defaults(page, tmp_path_factory: pytest.TempPathFactory):
    """--ui-config (llama-server's setting names) sets the defaults of a browser with no saved
    settings; its own saved settings win."""
    from hybridmoe.engine.llm import DEMO_MODEL

    if not Path(DEMO_MODEL).exists():
        pytest.skip(f"demo model not bundled at {DEMO_MODEL}")
    config = '{"systemMessage": "Answer in one sentence.", "temperature": 0, "max_tokens": -1, "top_k": 5}'
    srv = start_server(str(DEMO_MODEL), ["-t", "1", "-np", "1", "--ui-config", config],
                       tmp_path_factory.mktemp("uiconfig") / "s.log", None)
    try:
        sent: list[dict] = []
        page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
        page.goto(srv.base_url + "/")
        page.wait_for_selector("#server-status.ok")
        send(page, "Who was David?")
        page.wait_for_selector(".msg.assistant .msg-meta:has-text('tok/s')")
        assert sent[0]["messages"][0] == {"role": "system", "content": "Answer in one sentence."}
        assert sent[0]["temperature"] == 0 and sent[0]["top_k"] == 5 and "max_tokens" not in sent[0]
        page.evaluate("localStorage.setItem('hybridmoe.settings', JSON.stringify({temperature: '0.7'}))")
        page.reload()
        page.wait_for_selector("#server-status.ok")
        send(page, "And Saul?")
        page.wait_for_selector(".msg.assistant >> nth=1")
        page.wait_for_function("document.querySelectorAll('.msg-meta').length >= 2")
        assert sent[1]["temperature"] == 0.7 and sent[1]["messages"][0]["role"] == "user"
    finally:
        stop_server(srv)


def test_the_page_follows_the_systems_dark_theme(browser, demo_server: ServerProcess):
    colors = {}
    for scheme in ("light", "dark"):
        context = browser.new_context(color_scheme=scheme)
        pg = context.new_page()
        pg.goto(demo_server.base_url + "/")
        colors[scheme] = pg.evaluate("[getComputedStyle(document.body).backgroundColor, "
                                     "getComputedStyle(document.querySelector('#input')).color]")
        context.close()
    assert colors["light"] == ["rgb(247, 247, 248)", "rgb(29, 33, 37)"]
    assert colors["dark"] == ["rgb(23, 25, 28)", "rgb(227, 230, 234)"]


def test_markdown_renderer_builds_only_safe_nodes(page, demo_server: ServerProcess):
    page.goto(demo_server.base_url + "/")
    cases = {
        "<img src=x onerror=alert(1)>": "<p>&lt;img src=x onerror=alert(1)&gt;</p>",
        "**b** *e* ~~d~~ `c <b>` snake_case_name 2 * 3 a\\*b":
            "<p><strong>b</strong> <em>e</em> <del>d</del> <code>c &lt;b&gt;</code> snake_case_name 2 * 3 a*b</p>",
        "[x](javascript:alert(1)) [y](data:text/html,hi) [z](/relative)":
            '<p><span class="md-unsafe-link" title="link removed: only http(s) and mailto links are kept">x</span> '
            '<span class="md-unsafe-link" title="link removed: only http(s) and mailto links are kept">y</span> '
            '<span class="md-unsafe-link" title="link removed: only http(s) and mailto links are kept">z</span></p>',
        "![pic](https://e.com/a.png) see https://e.org/x.":
            '<p><a href="https://e.com/a.png" target="_blank" rel="noopener noreferrer nofollow">[image: pic]</a>'
            ' see <a href="https://e.org/x" target="_blank" rel="noopener noreferrer nofollow">https://e.org/x</a>.</p>',
        "```js\nx = '<script>'\n```":
            '<div class="code-block"><div class="code-head"><span class="code-lang">js</span>'
            '<button class="code-copy" type="button">Copy</button></div>'
            "<pre><code data-lang=\"js\">x = '&lt;script&gt;'</code></pre></div>",
        "- a\n- b\n  - c\n- d\n\n1. one\n2. two":
            "<ul><li>a</li><li>b<ul><li>c</li></ul></li><li>d</li></ul><ol><li>one</li><li>two</li></ol>",
        "| a | b |\n|---|--:|\n| 1 | <i>2</i> |":
            '<div class="table-wrap"><table><thead><tr><th>a</th><th style="text-align: right;">b</th></tr></thead>'
            '<tbody><tr><td>1</td><td style="text-align: right;">&lt;i&gt;2&lt;/i&gt;</td></tr></tbody></table></div>',
        "## T\nline one\nline two\n\n> quote\n\n---":
            "<h2>T</h2><p>line one<br>line two</p><blockquote><p>quote</p></blockquote><hr>",
    }
    rendered = page.evaluate("""async (inputs) => {
        const md = await import('/webui/markdown.js');
        return inputs.map((text) => {
            const box = document.createElement('div');
            box.append(md.renderMarkdown(text));
            return box.innerHTML;
        });
    }""", list(cases))
    assert dict(zip(cases, rendered)) == cases
