"""Acceptance check for the demo model through `hybridmoe serve` (default sampling, fixed seeds).

Three sets, each request with its own seed:
  chat       20 questions: a reply of >= 5 words that ends with finish_reason "stop"
  reasoning  10 questions with reasoning_effort "high" (server at --reasoning-format auto): non-empty
             reasoning_content and content
  tool       10 verse questions with the lookup_verse tool offered (verses never asked in training):
             a tool call with parseable JSON naming an existing verse / the asked verse; then the
             tool's result is sent back and the final answer must contain the verse text
Prints a table and writes demo/work/chat_check.json.
Run: python demo/chat_check.py [--model PATH] [--port N]
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORK = HERE / "work"
sys.path.insert(0, str(HERE))
from lookup_verse import LOOKUP_VERSE_TOOL, canonical_book, load_verses, lookup_verse  # noqa: E402

CHAT_PROMPTS = [
    "Hello! Who are you?", "What is a cat?", "Tell me about the sea.", "Write a short poem about the moon.",
    "What is the meaning of life?", "How do I read a file in Python?", "Define happiness.",
    "Tell me a story about a king.", "What does a dictionary do?", "Why is the sky blue?",
    "Explain a list comprehension.", "Who was David?", "What is wisdom?", "Describe a storm at night.",
    "Give me some advice.", "What is a function?", "Say something about mercy.", "What is an exception?",
    "Tell me about the mountains.", "What is a lawyer?",
]
REASONING_PROMPTS = [
    "What is patience?", "Tell me about the river Jordan.", "What is a Python module?", "Explain mercy.",
    "What is a politician?", "Tell me about the shepherd.", "What does a decorator do?", "What is faith?",
    "Describe the temple.", "What is a critic?",
]
# (question, book, chapter, verse): the corpus never asks for these verses (corpus.HELDOUT_VERSES).
VERSE_PROMPTS = [
    ("What does John 3:16 say?", "John", 3, 16), ("Look up Psalm 23:1.", "Psalms", 23, 1),
    ("What is written in Genesis 1:1?", "Genesis", 1, 1), ("Quote Romans 8:28.", "Romans", 8, 28),
    ("Can you show me Proverbs 3:5?", "Proverbs", 3, 5), ("What does Matthew 5:9 say?", "Matthew", 5, 9),
    ("Read Isaiah 40:31 to me.", "Isaiah", 40, 31), ("What does 1 Corinthians 13:4 say?", "1 Corinthians", 13, 4),
    ("Please give me the text of Philippians 4:13.", "Philippians", 4, 13),
    ("Find Jeremiah 29:11 in the Bible.", "Jeremiah", 29, 11),
]


def post(url: str, body: dict, timeout: float = 300.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    raise TimeoutError("server not ready")


def words(text: str | None) -> int:
    return len((text or "").split())


def chat_case(url: str, prompt: str, seed: int, max_tokens: int) -> dict[str, Any]:
    r = post(url, {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "seed": seed})
    ch = r["choices"][0]
    content = ch["message"].get("content")
    return {"prompt": prompt, "finish_reason": ch["finish_reason"], "content": content,
            "reasoning": ch["message"].get("reasoning_content"),
            "ok": ch["finish_reason"] == "stop" and words(content) >= 5}


def reasoning_case(url: str, prompt: str, seed: int, max_tokens: int) -> dict[str, Any]:
    r = post(url, {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "seed": seed,
                   "reasoning_effort": "high"})
    msg = r["choices"][0]["message"]
    return {"prompt": prompt, "finish_reason": r["choices"][0]["finish_reason"],
            "reasoning": msg.get("reasoning_content"), "content": msg.get("content"),
            "ok": bool((msg.get("reasoning_content") or "").strip()) and bool((msg.get("content") or "").strip())}


def tool_case(url: str, prompt: str, want: tuple[str, int, int], seed: int, max_tokens: int) -> dict[str, Any]:
    """One tool round trip: the call, the tool's result sent back, the final answer."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    body = {"messages": messages, "tools": [LOOKUP_VERSE_TOOL], "max_tokens": max_tokens, "seed": seed}
    r = post(url, body)
    msg = r["choices"][0]["message"]
    out: dict[str, Any] = {"prompt": prompt, "finish_reason": r["choices"][0]["finish_reason"],
                           "call": None, "well_formed": False, "asked_verse": False, "answer": None,
                           "quotes_verse": False}
    calls = msg.get("tool_calls") or []
    if not calls:
        out["content"] = msg.get("content")
        return out
    fn = calls[0]["function"]
    out["call"] = f"{fn['name']}({fn['arguments']})"
    try:
        args = json.loads(fn["arguments"])
    except json.JSONDecodeError:
        return out  # the server (rightly) refuses to take such a call back in the history
    if not isinstance(args, dict) or set(args) != {"book", "chapter", "verse"}:
        return out
    result = lookup_verse(**args)
    out["well_formed"] = fn["name"] == "lookup_verse" and not result.startswith("Error")
    book, chapter, verse = want
    out["asked_verse"] = (canonical_book(str(args["book"])) == canonical_book(book)
                          and args["chapter"] == chapter and args["verse"] == verse)
    messages += [{"role": "assistant", "content": msg.get("content"), "tool_calls": calls},
                 {"role": "tool", "tool_call_id": calls[0].get("id", "call_0"), "content": result}]
    r2 = post(url, {**body, "messages": messages})
    answer = r2["choices"][0]["message"].get("content") or ""
    out["answer"] = answer
    out["quotes_verse"] = not result.startswith("Error") and " ".join(result.split()) in " ".join(answer.split())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--port", type=int, default=0, help="0: a free port")
    ap.add_argument("--max-tokens", type=int, default=300)
    args = ap.parse_args()
    port = args.port or free_port()
    cmd = [sys.executable, "-m", "hybridmoe.cli", "serve", "--port", str(port), "-t", "1",
           "--reasoning-format", "auto"]
    if args.model:
        cmd += ["-m", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    url = base + "/v1/chat/completions"
    load_verses()
    res: dict[str, list[dict[str, Any]]] = {"chat": [], "reasoning": [], "tool": []}
    try:
        wait_ready(base, proc)
        for i, p in enumerate(CHAT_PROMPTS):
            res["chat"].append(chat_case(url, p, i, args.max_tokens))
            print(json.dumps(res["chat"][-1]), flush=True)
        for i, p in enumerate(REASONING_PROMPTS):
            res["reasoning"].append(reasoning_case(url, p, i, args.max_tokens))
            print(json.dumps(res["reasoning"][-1]), flush=True)
        for i, (p, *want) in enumerate(VERSE_PROMPTS):
            res["tool"].append(tool_case(url, p, tuple(want), i, args.max_tokens))
            print(json.dumps(res["tool"][-1]), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    chat, reas, tool = res["chat"], res["reasoning"], res["tool"]
    rows = [
        ("chat: reply >= 5 words and stop", sum(r["ok"] for r in chat), len(chat), 18),
        ("chat: finish_reason stop", sum(r["finish_reason"] == "stop" for r in chat), len(chat), len(chat)),
        ("reasoning: reasoning_content and content", sum(r["ok"] for r in reas), len(reas), 8),
        ("tool: well-formed call, existing verse", sum(r["well_formed"] for r in tool), len(tool), 8),
        ("tool: the asked verse", sum(r["asked_verse"] for r in tool), len(tool), 6),
        ("tool: final answer quotes the verse", sum(r["quotes_verse"] for r in tool), len(tool), 6),
    ]
    summary = {"table": [{"check": c, "passed": n, "of": m, "needed": need} for c, n, m, need in rows], **res}
    (WORK / "chat_check.json").write_text(json.dumps(summary, indent=1))
    print(f"\n| check | passed | needed |\n|---|---|---|")
    for c, n, m, need in rows:
        print(f"| {c} | {n}/{m} | {need} |")


if __name__ == "__main__":
    main()
