// hybridmoe chat page: conversations in localStorage, replies streamed from /v1/chat/completions.
// No framework and no build step; model text is rendered only through markdown.js (DOM nodes).

import { renderMarkdown } from "./markdown.js";

const STORE = {
  conversations: "hybridmoe.conversations",
  current: "hybridmoe.current",
  settings: "hybridmoe.settings",
  apiKey: "hybridmoe.apiKey",
};
const DEFAULT_SETTINGS = {
  system: "", temperature: "", top_p: "", top_k: "", min_p: "", repeat_penalty: "", max_tokens: "",
  reasoning_effort: "", reasoning_budget_tokens: "",
};
const $ = (id) => document.getElementById(id);

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

function load(key, fallback) {
  try {
    const raw = localStorage.getItem(key);
    return raw === null ? fallback : JSON.parse(raw);
  } catch {
    return fallback;
  }
}

const state = {
  conversations: load(STORE.conversations, []),
  currentId: load(STORE.current, null),
  settings: { ...DEFAULT_SETTINGS, ...load(STORE.settings, {}) },
  streaming: null,  // {conv, msg, controller} while a reply streams
  msgEls: new Map(),  // message object -> its element in the open conversation
};

// A page closed mid-reply left a message marked as streaming: it was cut short.
for (const conv of state.conversations) {
  for (const msg of conv.messages) {
    if (msg.streaming) {
      delete msg.streaming;
      msg.stopped = true;
    }
  }
}

function persist() {
  try {
    localStorage.setItem(STORE.conversations, JSON.stringify(state.conversations));
    localStorage.setItem(STORE.current, JSON.stringify(state.currentId));
  } catch (e) {
    setStatus(`could not save conversations: ${e.message}`, "error");
  }
}

function setStatus(text, kind = "") {
  const s = $("server-status");
  s.textContent = text;
  s.className = kind;
}

// Not crypto.randomUUID: it exists only in secure contexts, and the page may be served over plain
// http on a LAN address.
const newId = () => `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 10)}`;

const currentConv = () => state.conversations.find((c) => c.id === state.currentId) || null;

// ---- API access: the key lives in this browser and goes with every API call ----------------------

let keyPrompt = null;

/** Shows the key dialog; resolves to the saved key, or null when cancelled. */
function askForKey(reason) {
  if (keyPrompt) return keyPrompt;
  const dialog = $("key-dialog");
  $("key-reason").textContent = reason;
  $("key-input").value = "";
  keyPrompt = new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      const value = dialog.returnValue === "save" ? $("key-input").value.trim() : "";
      if (value) localStorage.setItem(STORE.apiKey, value);
      keyPrompt = null;
      resolve(value || null);
    }, { once: true });
  });
  dialog.returnValue = "";
  dialog.showModal();
  $("key-input").focus();
  return keyPrompt;
}

/** fetch with the stored key; on 401 asks for a key and tries again (until cancelled). */
async function apiFetch(path, init = {}) {
  for (;;) {
    const key = localStorage.getItem(STORE.apiKey);
    const headers = new Headers(init.headers || {});
    if (key) headers.set("Authorization", `Bearer ${key}`);
    const res = await fetch(path, { ...init, headers });
    if (res.status !== 401) return res;
    const reason = key ? "The server refused the saved API key. Enter another one." : "This server needs an API key.";
    if ((await askForKey(reason)) === null) return res;
  }
}

async function errorText(res) {
  const raw = await res.text();
  try {
    const err = JSON.parse(raw).error;
    return `${res.status}: ${err.message ?? JSON.stringify(err)}`;
  } catch {
    return `${res.status}: ${raw.slice(0, 300) || res.statusText}`;
  }
}

async function loadServerInfo() {
  try {
    const health = await fetch("health");
    if (health.status === 503) {
      setStatus("loading model…");
      setTimeout(loadServerInfo, 2000);
      return;
    }
    const res = await apiFetch("props");
    if (!res.ok) {
      setStatus(await errorText(res), "error");
      return;
    }
    const props = await res.json();
    applyServerDefaults(props.ui_settings);
    $("model-name").textContent = props.model_alias || "";
    const ctx = props.default_generation_settings?.n_ctx;
    setStatus(ctx ? `ready · context ${ctx} tokens per slot` : "ready", "ok");
  } catch (e) {
    setStatus(`server unreachable: ${e.message}`, "error");
  }
}

// The server's --ui-config (llama-server's setting names) -> ours. They are the defaults of a
// browser that has saved no settings of its own; saving the settings dialog keeps its values.
const SERVER_SETTING_NAMES = {
  systemMessage: "system", temperature: "temperature", top_k: "top_k", top_p: "top_p", min_p: "min_p",
  repeat_penalty: "repeat_penalty", max_tokens: "max_tokens",
};

function applyServerDefaults(uiSettings) {
  if (!uiSettings || localStorage.getItem(STORE.settings) !== null) return;
  for (const [theirs, ours] of Object.entries(SERVER_SETTING_NAMES)) {
    const v = uiSettings[theirs];
    if (ours === "max_tokens" && Number(v) < 1) continue;  // llama-server's -1: no limit, our empty field
    if (typeof v === "string" || typeof v === "number") state.settings[ours] = String(v);
  }
}

// ---- rendering ---------------------------------------------------------------------------------

function renderSidebar() {
  const list = $("conversations");
  list.replaceChildren();
  for (const conv of [...state.conversations].sort((a, b) => b.updated - a.updated)) {
    const item = el("li", conv.id === state.currentId ? "active" : "");
    const open = el("button", "conv-open", conv.title || "New chat");
    open.type = "button";
    open.title = conv.title;
    open.addEventListener("click", () => selectConversation(conv.id));
    const del = el("button", "conv-delete", "×");
    del.type = "button";
    del.title = "Delete conversation";
    del.setAttribute("aria-label", "Delete conversation");
    del.addEventListener("click", () => deleteConversation(conv.id));
    item.append(open, del);
    list.append(item);
  }
}

function messageEl(msg) {
  const wrap = el("div", `msg ${msg.role}`);
  wrap.append(el("div", "msg-role", msg.role === "user" ? "You" : "Assistant"));
  if (msg.role === "assistant") {
    const details = el("details", "reasoning");
    details.dataset.auto = "1";  // opened while reasoning streams, until the user toggles it
    const summary = el("summary", null, "Reasoning");
    summary.addEventListener("click", () => { details.dataset.auto = "0"; });
    details.append(summary, el("div", "reasoning-body md"));
    wrap.append(details, el("div", "content md"), el("div", "tool-calls"));
  } else {
    wrap.append(el("div", "content plain"));
  }
  wrap.append(el("div", "msg-meta"), el("div", "msg-error"), el("div", "msg-actions"));
  return wrap;
}

/** Regenerate on the last reply, Edit on the user's messages; none while a reply streams. */
function actionButtons(msg) {
  const conv = currentConv();
  if (state.streaming || !conv) return [];
  const button = (cls, text, title, onClick) => {
    const b = el("button", `msg-action ${cls}`, text);
    b.type = "button";
    b.title = title;
    b.addEventListener("click", onClick);
    return b;
  };
  const i = conv.messages.indexOf(msg);
  if (msg.role === "user") {
    return [button("msg-edit", "Edit", "Take this message back into the box: it and what follows are removed",
                   () => editFrom(conv, i))];
  }
  const copy = button("msg-copy", "Copy", "Copy the reply's text (Markdown)", () => copyReply(msg, copy));
  if (i === conv.messages.length - 1) {
    return [copy, button("msg-regenerate", "Regenerate", "Write this reply again", () => regenerate(conv))];
  }
  return [copy];
}

/** The reply's Markdown to the clipboard; where the page may not write it (plain http on a LAN
 * address), the shown text is selected for Ctrl+C instead. */
function copyReply(msg, button) {
  if (navigator.clipboard) {
    navigator.clipboard.writeText(msg.content || "").then(() => { button.textContent = "Copied"; }, () => {});
  } else {
    const shown = state.msgEls.get(msg)?.querySelector(".content");
    if (shown) window.getSelection().selectAllChildren(shown);
  }
}

function toolCallEl(call) {
  const box = el("div", "tool-call");
  const head = el("div", "tool-call-head");
  head.append(el("span", "tool-call-label", "Tool call"), el("code", "tool-call-name", call.name || "?"));
  let args = call.arguments || "";
  try {
    args = JSON.stringify(JSON.parse(args), null, 2);
  } catch {
    // still streaming, or not JSON: shown as sent
  }
  const pre = el("pre");
  pre.append(el("code", "tool-call-args", args));
  box.append(head, pre);
  return box;
}

function metaText(msg) {
  if (msg.streaming) {
    const p = msg.progress;
    if (!p || msg.content || msg.reasoning || msg.toolCalls.length) return "generating…";
    const reused = p.cache > 0 ? ` (${p.cache} reused)` : "";
    return `reading the prompt: ${p.processed} / ${p.total} tokens${reused}`;
  }
  const parts = [];
  const t = msg.timings;
  if (t && typeof t.predicted_per_second === "number") {
    parts.push(`${t.predicted_n} tokens · ${t.predicted_per_second.toFixed(1)} tok/s`);
    if (typeof t.prompt_per_second === "number" && t.prompt_n > 0) {
      parts.push(`prompt ${t.prompt_n} tokens · ${t.prompt_per_second.toFixed(1)} tok/s`);
    }
    if (t.cache_n > 0) parts.push(`${t.cache_n} reused`);  // the conversation so far, not computed again
  }
  if (msg.stopped) parts.push("stopped");
  else if (msg.finish && msg.finish !== "stop") parts.push(`finish: ${msg.finish}`);
  return parts.join(" · ");
}

function fill(wrap, msg) {
  const content = wrap.querySelector(".content");
  if (msg.role === "user") {
    content.textContent = msg.content;
  } else {
    content.replaceChildren(renderMarkdown(msg.content || ""));
    const details = wrap.querySelector(".reasoning");
    details.hidden = !msg.reasoning;
    if (msg.reasoning) {
      details.querySelector(".reasoning-body").replaceChildren(renderMarkdown(msg.reasoning));
      const thinking = msg.streaming && !msg.content && !msg.toolCalls?.length;
      details.querySelector("summary").textContent = thinking ? "Reasoning…" : "Reasoning";
      if (details.dataset.auto === "1") details.open = Boolean(thinking);
    }
    wrap.querySelector(".tool-calls").replaceChildren(...(msg.toolCalls || []).map(toolCallEl));
  }
  wrap.querySelector(".msg-meta").textContent = metaText(msg);
  wrap.querySelector(".msg-error").textContent = msg.error || "";
  wrap.querySelector(".msg-actions").replaceChildren(...actionButtons(msg));
}

function nearBottom(box) {
  return box.scrollHeight - box.scrollTop - box.clientHeight < 80;
}

function renderMessages() {
  const box = $("messages");
  box.replaceChildren();
  state.msgEls = new Map();
  const conv = currentConv();
  $("chat-title").textContent = conv?.title || "New chat";
  if (!conv || !conv.messages.length) {
    box.append(el("div", "empty", "Send a message to start a conversation."));
    return;
  }
  for (const msg of conv.messages) {
    const wrap = messageEl(msg);
    state.msgEls.set(msg, wrap);
    fill(wrap, msg);
    box.append(wrap);
  }
  box.scrollTop = box.scrollHeight;
}

function refresh(msg) {
  const wrap = state.msgEls.get(msg);
  if (!wrap) return;
  const box = $("messages");
  const stick = nearBottom(box);
  fill(wrap, msg);
  if (stick) box.scrollTop = box.scrollHeight;
}

let dirty = new Set();
let frame = 0;

function scheduleRefresh(msg) {
  dirty.add(msg);
  if (frame) return;
  frame = requestAnimationFrame(() => {
    frame = 0;
    const msgs = dirty;
    dirty = new Set();
    msgs.forEach(refresh);
  });
}

// ---- conversations -----------------------------------------------------------------------------

function selectConversation(id) {
  state.currentId = id;
  persist();
  renderSidebar();
  renderMessages();
}

function deleteConversation(id) {
  if (state.streaming?.conv.id === id) state.streaming.controller.abort();
  state.conversations = state.conversations.filter((c) => c.id !== id);
  if (state.currentId === id) state.currentId = null;
  persist();
  renderSidebar();
  renderMessages();
}

function newConversation() {
  state.currentId = null;
  persist();
  renderSidebar();
  renderMessages();
  $("input").focus();
}

// ---- sending and streaming ---------------------------------------------------------------------

function requestBody(history) {
  const s = state.settings;
  const messages = [];
  if (s.system.trim()) messages.push({ role: "system", content: s.system });
  for (const m of history) {
    // Only text goes back: tool calls were not run here, so they have no results to pair with.
    if (m.role === "user") messages.push({ role: "user", content: m.content });
    else if (m.content) messages.push({ role: "assistant", content: m.content });
  }
  // reasoning_control: the "Answer now" button may end the thinking (/v1/chat/completions/control)
  // return_progress: how far a long prompt has been read, shown while it is (minutes on a few cores)
  const body = { messages, stream: true, stream_options: { include_usage: true }, reasoning_control: true,
                 return_progress: true };
  if (s.temperature !== "") body.temperature = Number(s.temperature);
  if (s.top_p !== "") body.top_p = Number(s.top_p);
  if (s.top_k !== "") body.top_k = parseInt(s.top_k, 10);
  if (s.min_p !== "") body.min_p = Number(s.min_p);
  if (s.repeat_penalty !== "") body.repeat_penalty = Number(s.repeat_penalty);
  if (s.max_tokens !== "") body.max_tokens = parseInt(s.max_tokens, 10);
  if (s.reasoning_effort) body.reasoning_effort = s.reasoning_effort;
  if (s.reasoning_budget_tokens !== "") body.reasoning_budget_tokens = parseInt(s.reasoning_budget_tokens, 10);
  return body;
}

/** Calls onEvent with each parsed `data:` object of a server-sent event stream, until [DONE]. */
async function readEvents(res, onEvent) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf = (buf + decoder.decode(value, { stream: true })).replace(/\r\n/g, "\n");
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, end);
      buf = buf.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      try {
        onEvent(JSON.parse(data));
      } catch (e) {
        if (!(e instanceof SyntaxError)) throw e;
      }
    }
  }
}

function onChunk(msg, chunk) {
  if (chunk.id && state.streaming?.msg === msg) state.streaming.id = chunk.id;
  if (chunk.error) msg.error = chunk.error.message || JSON.stringify(chunk.error);
  if (chunk.prompt_progress) msg.progress = chunk.prompt_progress;
  const choice = chunk.choices?.[0];
  if (choice) {
    const d = choice.delta || {};
    if (d.reasoning_content) msg.reasoning += d.reasoning_content;
    if (d.content) msg.content += d.content;
    for (const tc of d.tool_calls || []) {
      const i = tc.index ?? msg.toolCalls.length;
      msg.toolCalls[i] ||= { id: "", name: "", arguments: "" };
      const call = msg.toolCalls[i];
      if (tc.id) call.id = tc.id;
      if (tc.function?.name) call.name += tc.function.name;
      if (tc.function?.arguments) call.arguments += tc.function.arguments;
    }
    if (choice.finish_reason) msg.finish = choice.finish_reason;
  }
  if (chunk.timings) msg.timings = chunk.timings;
  if (chunk.usage) msg.usage = chunk.usage;
  scheduleRefresh(msg);
  showAnswerNow();
}

/** "Answer now" while the reply is still thinking (and was not asked to stop already). */
function showAnswerNow() {
  const s = state.streaming;
  const thinking = s && s.id && !s.endAsked && s.msg.reasoning && !s.msg.content && !s.msg.toolCalls.length;
  $("answer-now").hidden = !thinking;
}

/** Ends the streaming reply's thinking: the model goes on to its answer. */
async function answerNow() {
  const s = state.streaming;
  if (!s?.id || s.endAsked) return;
  s.endAsked = true;
  showAnswerNow();
  try {
    await apiFetch("v1/chat/completions/control", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ id: s.id, action: "reasoning_end" }),
    });
  } catch {
    // the reply goes on thinking; nothing else to do
  }
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  if (!busy) $("answer-now").hidden = true;
}

async function send(text) {
  let conv = currentConv();
  if (!conv) {
    conv = { id: newId(), title: "", updated: Date.now(), messages: [] };
    state.conversations.push(conv);
    state.currentId = conv.id;
  }
  if (!conv.title) conv.title = text.replace(/\s+/g, " ").slice(0, 60);
  conv.messages.push({ role: "user", content: text });
  await streamReply(conv);
}

/** The last reply again, from the same conversation (the server reuses the prompt it computed). */
async function regenerate(conv) {
  if (state.streaming || conv.messages.at(-1)?.role !== "assistant") return;
  conv.messages.pop();
  await streamReply(conv);
}

/** Message i goes back into the input box; it and everything after it leave the conversation. */
function editFrom(conv, i) {
  if (state.streaming) return;
  $("input").value = conv.messages[i].content;
  conv.messages.splice(i);
  conv.updated = Date.now();
  persist();
  renderMessages();
  $("input").focus();
}

/** Streams the assistant's reply to conv.messages (which ends with the user's turn). */
async function streamReply(conv) {
  const body = JSON.stringify(requestBody(conv.messages));
  const msg = { role: "assistant", content: "", reasoning: "", toolCalls: [], streaming: true };
  conv.messages.push(msg);
  conv.updated = Date.now();
  const controller = new AbortController();
  state.streaming = { conv, msg, controller };
  setBusy(true);
  persist();
  renderSidebar();
  renderMessages();
  try {
    const res = await apiFetch("v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body,
      signal: controller.signal,
    });
    if (res.ok) await readEvents(res, (chunk) => onChunk(msg, chunk));
    else msg.error = await errorText(res);
  } catch (e) {
    if (e.name === "AbortError") msg.stopped = true;
    else msg.error = e.message || String(e);
  } finally {
    delete msg.streaming;
    delete msg.progress;
    state.streaming = null;
    conv.updated = Date.now();
    persist();
    setBusy(false);
    conv.messages.forEach(refresh);  // the reply's meta, and every message's actions are back
    renderSidebar();
  }
}

// ---- settings ----------------------------------------------------------------------------------

const SETTING_FIELDS = {
  system: "set-system",
  temperature: "set-temperature",
  top_p: "set-top-p",
  top_k: "set-top-k",
  min_p: "set-min-p",
  repeat_penalty: "set-repeat-penalty",
  max_tokens: "set-max-tokens",
  reasoning_effort: "set-reasoning-effort",
  reasoning_budget_tokens: "set-reasoning-budget",
};

function openSettings() {
  for (const [name, id] of Object.entries(SETTING_FIELDS)) $(id).value = state.settings[name];
  $("settings-dialog").returnValue = "";  // Escape keeps the previous value otherwise
  $("settings-dialog").showModal();
}

function closeSettings() {
  if ($("settings-dialog").returnValue !== "save") return;
  for (const [name, id] of Object.entries(SETTING_FIELDS)) state.settings[name] = $(id).value;
  localStorage.setItem(STORE.settings, JSON.stringify(state.settings));
}

// ---- wiring ------------------------------------------------------------------------------------

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("input").value.trim();
  if (!text || state.streaming) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.streaming?.controller.abort());
$("answer-now").addEventListener("click", answerNow);
$("new-chat").addEventListener("click", newConversation);
$("open-settings").addEventListener("click", openSettings);
$("settings-dialog").addEventListener("close", closeSettings);
$("forget-key").addEventListener("click", () => {
  localStorage.removeItem(STORE.apiKey);
  setStatus("API key forgotten");
});
$("key-cancel").addEventListener("click", () => $("key-dialog").close(""));

renderSidebar();
renderMessages();
loadServerInfo();
