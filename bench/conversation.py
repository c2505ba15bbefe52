"""Agent-like conversations against a server: how much of each turn's prompt comes from cache.

A session: a long system+tools prompt, then turns of (user message, greedy reply); every request
resends the whole conversation so far, as chat clients and coding agents do. Prompts are token ids
on llama-server's native `/completion` (both servers speak it), so the figure measures prompt reuse
itself, not how a random model's text re-tokenizes. Settings:
    np1      one session, -np 1
    np1x2    two sessions interleaved turn by turn on -np 1 (the RAM prompt cache swaps them)
    np2x2    two sessions interleaved on -np 2
    restart  one session, the server restarted (SIGTERM, then started again) before every turn from
             the second on: hybridmoe with --prompt-cache-dir keeps its cache, llama-server has none
Per turn: prompt tokens, cached tokens (timings.cache_n), prompt ms (timings.prompt_ms) and time to
first token measured by the client.

    python bench/conversation.py -m gpt-oss-20b-synth.gguf -t 2
    python bench/conversation.py -m model.gguf --llama-server /path/to/llama-server   # both engines
    python bench/conversation.py --system-tokens 300 --reply-tokens 40 --user-tokens 20   # tiny, quick
    python bench/conversation.py ... --json out.json     # also write the run's record (bench/record.py)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass

import machine
import record
from serve_load import free_port, wait_healthy


@dataclass
class Turn:
    engine: str
    setting: str
    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    prompt_ms: float
    ttft_ms: float
    reply_tokens: int


def post(url: str, body: dict, timeout: float = 3600.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def complete(url: str, prompt: list[int], n: int) -> tuple[list[int], dict, float]:
    """Stream one greedy `/completion`; returns (generated ids, timings, time to first token s)."""
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True, "cache_prompt": True,
            "stream": True, "return_tokens": True}
    req = urllib.request.Request(url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, tokens, timings = None, [], {}
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            new = chunk.get("tokens") or []
            if new and ttft is None:
                ttft = time.perf_counter() - t0
            tokens += new
            if chunk.get("stop"):
                timings = chunk.get("timings") or {}
    return tokens, timings, ttft if ttft is not None else time.perf_counter() - t0


def words(url: str, n_tokens: int, seed: int) -> list[int]:
    """About n_tokens of ordinary text, tokenized by the server (the same GGUF vocabulary)."""
    rng = random.Random(seed)
    vocab = ("the agent reads a file and calls a tool with arguments then checks the result "
             "function returns list value error path config test build run server model token cache").split()
    text = " ".join(rng.choice(vocab) for _ in range(n_tokens * 2))
    ids = post(url + "/tokenize", {"content": text, "add_special": False})["tokens"]
    ids = [t if isinstance(t, int) else t["id"] for t in ids]
    return ids[:n_tokens]


def run_setting(engine: str, url: str, setting: str, a: argparse.Namespace,
                restart: Callable[[], str] | None = None) -> list[Turn]:
    """restart: stops the server and starts it again, returning its url (before turns 2, 3, ...)."""
    n_sessions = 1 if setting in ("np1", "restart") else 2
    convs = [words(url, a.system_tokens, 1000 + s) for s in range(n_sessions)]
    out = []
    for turn in range(1, a.turns + 1):
        if restart is not None and turn > 1:
            url = restart()
        for s in range(n_sessions):
            prompt = convs[s] + words(url, a.user_tokens, 10 * turn + s)
            reply, t, ttft = complete(url, prompt, a.reply_tokens)
            out.append(Turn(engine, setting, s, turn, len(prompt), int(t.get("cache_n", 0)),
                            float(t.get("prompt_ms", 0.0)), ttft * 1e3, len(reply)))
            convs[s] = prompt + reply
            print(f"  {engine:>10} {setting:>6} s{s} turn {turn}: prompt {len(prompt):>6} cached "
                  f"{out[-1].cached_tokens:>6} ({100 * out[-1].cached_tokens / len(prompt):5.1f}%) prompt "
                  f"{out[-1].prompt_ms:8.0f} ms ttft {out[-1].ttft_ms:8.0f} ms", flush=True)
    return out


def start(cmd: list[str], url: str, log: str) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return wait_healthy(proc, url, 900, f"{cmd[0]} (log {log})")


def server_cmd(engine: str, a: argparse.Namespace, model: str, np_: int, port: int,
               cache_dir: str | None = None) -> list[str]:
    common = ["-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", str(np_), "-c", str(a.ctx * np_),
              "-t", str(a.threads)]
    if engine == "llama.cpp":
        return [a.llama_server, *common, "-fa", "on", "--no-jinja", "--chat-template", "chatml"]  # ids only: no template
    return [sys.executable, "-m", "hybridmoe.cli", "serve", *common,
            *(["--prompt-cache-dir", cache_dir] if cache_dir else [])]


def llama_server_version(path: str) -> str:
    r = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    lines = [ln.strip() for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    return "; ".join(lines[:2]) or "unknown"


def summarize(turns: list[Turn]) -> None:
    print(f"\n{'engine':>10} {'setting':>7} {'turn':>4} {'prompt':>7} {'cached':>7} {'cached %':>8} "
          f"{'prompt ms':>10} {'ttft ms':>9}")
    for t in turns:
        print(f"{t.engine:>10} {t.setting:>7} {t.turn:>4} {t.prompt_tokens:>7} {t.cached_tokens:>7} "
              f"{100 * t.cached_tokens / t.prompt_tokens:>7.1f}% {t.prompt_ms:>10.0f} {t.ttft_ms:>9.0f}")
    print("\ntargets: from turn 2 on >= 95% of every prompt cached; turn-8 ttft <= 1.5x turn 2 (per session)")
    for (eng, setting) in sorted({(t.engine, t.setting) for t in turns}):
        rows = [t for t in turns if t.engine == eng and t.setting == setting]
        later = [t for t in rows if t.turn >= 2]
        worst = min((t.cached_tokens / t.prompt_tokens for t in later), default=float("nan"))
        ratios = []
        for s in {t.session for t in rows}:
            by = {t.turn: t for t in rows if t.session == s}
            if 2 in by and max(by) > 2:
                ratios.append(by[max(by)].ttft_ms / by[2].ttft_ms)
        print(f"  {eng:>10} {setting:>6}: worst cached share from turn 2: {100 * worst:.1f}%; "
              f"last-turn / turn-2 ttft: {', '.join(f'{r:.2f}x' for r in ratios)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None, help="GGUF (default: a synthetic tiny model)")
    ap.add_argument("--url", default=None, help="measure an already running server (one setting, named 'url')")
    ap.add_argument("--llama-server", default=None, help="also run llama.cpp's llama-server binary at this path")
    ap.add_argument("--settings", default="np1,np1x2,np2x2")
    ap.add_argument("--engines", default="hybridmoe,llama.cpp",
                    help="which to run (llama.cpp only with --llama-server)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx", type=int, default=8192, help="context per slot")
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--reply-tokens", type=int, default=200)
    ap.add_argument("--user-tokens", type=int, default=100)
    record.add_json_arg(ap)
    a = ap.parse_args()
    print(machine.describe())
    rec = record.new("conversation", {
        "model": os.path.basename(a.model) if a.model else ("server at --url" if a.url else "synthetic tiny"),
        "threads": a.threads, "ctx": a.ctx, "system_tokens": a.system_tokens, "user_tokens": a.user_tokens,
        "reply_tokens": a.reply_tokens, "turns": a.turns, "settings": a.settings.split(",")})
    if a.llama_server and "llama.cpp" in a.engines.split(",") and not a.url:
        rec["versions"]["llama.cpp"] = {"driver": "llama-server", "version": llama_server_version(a.llama_server)}
    turns: list[Turn] = []
    if a.url:
        turns = run_setting("server", a.url, "url", a)
    else:
        model = a.model
        if model is None:
            model = os.path.join(tempfile.mkdtemp(prefix="conversation_"), "tiny.gguf")
            subprocess.run([sys.executable, "-m", "hybridmoe.cli", "synth", "--preset", "tiny", "--out", model],
                           check=True, capture_output=True)
        engines = [e for e in a.engines.split(",") if e == "hybridmoe" or (e == "llama.cpp" and a.llama_server)]
        for engine in engines:
            for setting in a.settings.split(","):
                np_ = 2 if setting == "np2x2" else 1
                port = free_port()
                log = os.path.join(tempfile.gettempdir(), f"conversation-{engine}-{setting}.log")
                cache_dir = tempfile.mkdtemp(prefix="conversation-cache-") if setting == "restart" else None
                cmd = server_cmd(engine, a, model, np_, port, cache_dir if engine == "hybridmoe" else None)
                procs = [start(cmd, f"http://127.0.0.1:{port}", log)]

                def restart() -> str:
                    procs[-1].terminate()  # SIGTERM: a graceful stop, as a service manager does
                    procs[-1].wait(timeout=600)
                    procs.append(start(cmd, f"http://127.0.0.1:{port}", log + f".{len(procs)}"))
                    return f"http://127.0.0.1:{port}"

                try:
                    turns += run_setting(engine, f"http://127.0.0.1:{port}", setting, a,
                                         restart if setting == "restart" else None)
                finally:
                    procs[-1].terminate()
                    procs[-1].wait(timeout=600)
    summarize(turns)
    rec["rows"] = [asdict(t) for t in turns]
    record.write(rec, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
