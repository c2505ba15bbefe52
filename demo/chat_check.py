"""Acceptance check for the demo model: 20 varied chat requests through `hybridmoe serve`.

Starts the server on the given GGUF (default: the bundled demo), sends the requests one by one
(default sampling, max_tokens 200), and reports how many ended with finish_reason "stop".
Writes demo/work/chat_check.json.  Run: python demo/chat_check.py [--model PATH] [--port 8093]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

WORK = Path(__file__).resolve().parent / "work"
PROMPTS = [
    "Hello! Who are you?", "What is a cat?", "Tell me about the sea.", "Write a short poem about the moon.",
    "What is the meaning of life?", "How do I read a file in Python?", "Define happiness.",
    "Tell me a story about a king.", "What does a dictionary do?", "Why is the sky blue?",
    "Explain a list comprehension.", "Who was David?", "What is wisdom?", "Describe a storm at night.",
    "Give me some advice.", "What is a function?", "Say something about mercy.", "What is an exception?",
    "Tell me about the mountains.", "What is a lawyer?",
]


def post(url: str, body: dict, timeout: float = 300.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--port", type=int, default=8093)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("-n", type=int, default=len(PROMPTS), help="send only the first n prompts")
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "hybridmoe.cli", "serve", "--port", str(args.port), "-t", "1"]
    if args.model:
        cmd += ["-m", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{args.port}"
    results = []
    try:
        wait_ready(base, proc)
        for i, p in enumerate(PROMPTS[:args.n]):
            t = time.time()
            r = post(base + "/v1/chat/completions", {"messages": [{"role": "user", "content": p}],
                                                     "max_tokens": args.max_tokens, "seed": i})
            ch = r["choices"][0]
            results.append({"prompt": p, "finish_reason": ch["finish_reason"], "content": ch["message"].get("content"),
                            "completion_tokens": r.get("usage", {}).get("completion_tokens"),
                            "seconds": round(time.time() - t, 2)})
            print(json.dumps(results[-1]), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    stops = sum(r["finish_reason"] == "stop" for r in results)
    summary = {"requests": len(results), "stop": stops, "results": results}
    (WORK / "chat_check.json").write_text(json.dumps(summary, indent=1))
    print(f"{stops}/{len(results)} ended with finish_reason 'stop'")


if __name__ == "__main__":
    main()
