"""Big JSON schemas beside a normal chat (issue 16): does one request's schema stall the others?

Starts `hybridmoe serve` (the bundled demo model unless -m is given; 2 slots), measures a normal
chat's idle latency, then sends each big schema together with a normal chat and prints the big
request's status and time and the normal chat's latency next to its idle one.

    python bench/constrained_load.py
    python bench/constrained_load.py -m model.gguf --max-tokens 32 [--json out.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

import machine
import record

ENUM_100K = {"type": "object", "properties": {"v": {"enum": [f"value-{i}" for i in range(100_000)]}}}
PROPS_20K = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(20_000)}}
ENUM_10K = {"type": "object", "properties": {"v": {"enum": [f"value-{i}" for i in range(10_000)]}}}  # at the limit
PROPS_400 = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(400)}}  # at the limit


def post(url: str, body: dict) -> tuple[int, float, str]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=data, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            status, raw = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read().decode()
    dt = time.perf_counter() - t0
    out = json.loads(raw)
    detail = out["error"]["message"][:70] if "error" in out else out["choices"][0]["finish_reason"]
    return status, dt, detail


def chat(max_tokens: int, **extra: object) -> dict:
    return {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": max_tokens,
            "temperature": 0, **extra}


def normal(max_tokens: int) -> dict:
    return chat(max_tokens, ignore_eos=True)  # always max_tokens long: latencies compare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=32)
    record.add_json_arg(ap)
    args = ap.parse_args()
    print(machine.describe())
    rec = record.new("constrained_load", {"model": os.path.basename(args.model) if args.model else "bundled demo",
                                          "max_tokens": args.max_tokens, "parallel": 2, "threads": 1})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "hybridmoe.cli", "serve", "--port", str(port), "-np", "2", "-t", "1"]
    if args.model:
        cmd += ["-m", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        post(url, chat(4))  # warm up
        idle_runs = [post(url, normal(args.max_tokens))[1] for _ in range(3)]
        idle = statistics.median(idle_runs)
        rec["runs"].append({"case": "normal chat idle", "seconds": idle_runs})
        print(f"normal chat ({args.max_tokens} tokens) idle: {idle:.2f} s")
        print(f"{'schema':<22} {'big: status':>11} {'time s':>7}  {'normal s':>8} {'x idle':>6}  detail")
        for name, schema in [("enum 100,000", ENUM_100K), ("properties 20,000", PROPS_20K),
                             ("enum 10,000 (limit)", ENUM_10K), ("properties 400 (limit)", PROPS_400)]:
            big = chat(args.max_tokens, response_format={"type": "json_schema",
                                                         "json_schema": {"name": "x", "schema": schema}})
            with cf.ThreadPoolExecutor(2) as pool:
                fb = pool.submit(post, url, big)
                time.sleep(0.05)  # the big one first
                fn = pool.submit(post, url, normal(args.max_tokens))
                (bs, bt, bd), (_, nt, _) = fb.result(), fn.result()
            print(f"{name:<22} {bs:>11} {bt:>7.2f}  {nt:>8.2f} {nt / idle:>6.2f}  {bd}")
            rec["rows"].append({"schema": name, "status": bs, "big_s": bt, "normal_s": nt,
                                "normal / idle": nt / idle, "detail": bd})
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    rec["params"]["idle_normal_s"] = idle
    record.write(rec, args.json)


if __name__ == "__main__":
    main()
