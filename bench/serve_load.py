"""Load test for `hybridmoe serve`: N concurrent streaming chat clients, 1 vs 4 streams by default.

Prints aggregate generated tokens/s, request latency p50/p99, time to first token p50 and errors
per concurrency level. Without --url it starts its own server on 127.0.0.1 (a synthetic tiny
model unless -m is given) and stops it afterwards, and prints the server's peak memory: RSS (the
sum of each process's peak, so pages shared by replicas count once per replica) and PSS (shared
pages split among the processes that map them: the mmap'd experts counted once).
With --replicas N it starts `hybridmoe replicas -n N` instead (N pinned replicas behind the smg
gateway, docs/scale-out.md) and measures through the gateway.

    python bench/serve_load.py                      # tiny synthetic model, streams 1 and 4
    python bench/serve_load.py -m model.gguf --streams 1,2,4,8 --requests 16 --max-tokens 64
    python bench/serve_load.py -m model.gguf --streams 4,8 --replicas 2   # two replicas + gateway
    python bench/serve_load.py --url http://127.0.0.1:8080 --api-key KEY
    python bench/serve_load.py --json out.json      # also write the run's record (bench/record.py)
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
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import machine
import record


@dataclass
class Result:
    ok: bool
    latency_s: float
    ttft_s: float
    tokens: int
    error: str = ""


MODEL_ID = "gpt-oss"  # the gateway routes by model id (the replicas' --alias); one server serves any name


def stream_one(url: str, key: str | None, prompt: str, max_tokens: int, timeout_s: float,
               temperature: float = 0.0) -> Result:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), headers)
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            for line in r:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Result(False, time.perf_counter() - t0, 0.0, 0, chunk["error"]["message"])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    ttft = time.perf_counter() - t0
    except (urllib.error.URLError, OSError, ValueError) as e:
        return Result(False, time.perf_counter() - t0, 0.0, 0, str(e))
    latency = time.perf_counter() - t0
    return Result(True, latency, ttft if ttft is not None else latency, tokens)


def run_level(url: str, key: str | None, streams: int, n_requests: int, max_tokens: int,
              timeout_s: float, temperature: float = 0.0) -> tuple[float, list[Result]]:
    prompts = [f"Request {i}: write a short story about the number {i}." for i in range(n_requests)]
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(lambda p: stream_one(url, key, p, max_tokens, timeout_s, temperature), prompts))
    return time.perf_counter() - t0, results


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def synth_model() -> str:
    model = os.path.join(tempfile.mkdtemp(prefix="serve_load_"), "tiny.gguf")
    subprocess.run([sys.executable, "-m", "hybridmoe.cli", "synth", "--preset", "tiny", "--out", model],
                   check=True, capture_output=True)
    return model


def start_server(model: str | None, parallel: int, threads: int | None) -> tuple[subprocess.Popen, str]:
    if model is None:
        model = synth_model()
    port = free_port()
    cmd = [sys.executable, "-m", "hybridmoe.cli", "serve", "-m", model, "--host", "127.0.0.1",
           "--port", str(port), "-np", str(parallel)]
    if threads:
        cmd += ["-t", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    return wait_healthy(proc, url, 180, "server"), url


def start_replicas(model: str | None, n: int, parallel: int, threads: int | None) -> tuple[subprocess.Popen, str]:
    """`hybridmoe replicas -n N` on free ports (each replica -np `parallel`; `threads` split among
    them, else each runs one thread per core it is pinned to); ready once the gateway lists the model."""
    if model is None:
        model = synth_model()
    port, base = free_port(), free_port()
    while not all(free_port_at(p) for p in range(base, base + n)):
        base = free_port()
    cmd = [sys.executable, "-m", "hybridmoe.cli", "replicas", "-n", str(n), "--port", str(port),
           "--base-port", str(base), "--metrics-port", str(free_port()), "--alias", MODEL_ID,
           "--", "-m", model, "-np", str(parallel)]
    if threads:
        cmd += ["-t", str(max(1, threads // n))]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"hybridmoe replicas exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                if f'"{MODEL_ID}"'.encode() in r.read():
                    return proc, url
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("the gateway did not list the model within 600 s")


def free_port_at(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def _kib(path: str, field: str) -> int:
    """A `Field:  N kB` line of a /proc file, in KiB (0 if the process is gone)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class MemorySampler:
    """Peak memory of the server processes while the bench runs: the peak of their summed PSS
    (sampled), each one's peak RSS (the kernel's VmHWM) and the gateway's, in MiB."""

    def __init__(self, servers: list[int], gateway: int | None, interval_s: float = 0.2) -> None:
        self.servers, self.gateway = servers, gateway
        self.peak_pss_kib = 0
        self._hwm = {pid: 0 for pid in servers + ([gateway] if gateway else [])}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)

    def _sample(self) -> None:
        self.peak_pss_kib = max(self.peak_pss_kib,
                                sum(_kib(f"/proc/{p}/smaps_rollup", "Pss") for p in self.servers))
        for p in self._hwm:
            self._hwm[p] = max(self._hwm[p], _kib(f"/proc/{p}/status", "VmHWM"))

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self._sample()

    def start(self) -> MemorySampler:
        self._sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sample()

    def figures(self) -> dict[str, float]:
        mib = 1024.0
        return {"servers": len(self.servers),
                "peak_rss_sum_mib": sum(self._hwm[p] for p in self.servers) / mib,
                "peak_pss_mib": self.peak_pss_kib / mib,
                "gateway_peak_rss_mib": self._hwm[self.gateway] / mib if self.gateway else 0.0}


def server_pids(proc: subprocess.Popen, replicas: int) -> tuple[list[int], int | None]:
    """(the serving processes, the gateway): the started server itself, or the launcher's children."""
    if not replicas:
        return [proc.pid], None
    kids = _children(proc.pid)
    servers = [p for p in kids if "serve" in _cmdline(p)]
    gateway = next((p for p in kids if p not in servers), None)  # smg renames itself (setproctitle)
    return servers, gateway


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, what: str) -> subprocess.Popen:
    """Poll /health until 200; the process is stopped and the run ends if it dies or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    proc.terminate()
    raise SystemExit(f"{what} did not become healthy within {timeout_s:.0f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="existing server; default: start one")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("-m", "--model", default=None, help="GGUF for the started server (default: synthetic tiny)")
    ap.add_argument("--streams", default="1,4", help="comma-separated concurrency levels")
    ap.add_argument("--requests", type=int, default=8, help="requests per level")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="runs per level; the median throughput is shown")
    ap.add_argument("-t", "--threads", type=int, default=None,
                    help="server threads (started server only; with --replicas, split among them)")
    ap.add_argument("--replicas", type=int, default=0,
                    help="start N replicas behind the smg gateway (hybridmoe replicas) instead of one server")
    ap.add_argument("--timeout", type=float, default=300.0, help="per-request timeout in seconds")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy streams (the default); e.g. 0.8 to include the sampler's cost")
    record.add_json_arg(ap)
    args = ap.parse_args()
    levels = [int(x) for x in args.streams.split(",") if x.strip()]
    print(machine.describe())
    rec = record.new("serve_load", {"model": os.path.basename(args.model) if args.model else "synthetic tiny",
                                    "url": "given" if args.url else "started here", "streams": levels,
                                    "requests": args.requests, "max_tokens": args.max_tokens,
                                    "repeats": args.repeats, "threads": args.threads,
                                    "temperature": args.temperature, "replicas": args.replicas})
    proc = None
    url = args.url
    if url is None and args.replicas:
        proc, url = start_replicas(args.model, args.replicas, max(levels), args.threads)
    elif url is None:
        proc, url = start_server(args.model, max(levels), args.threads)
    sampler = MemorySampler(*server_pids(proc, args.replicas)).start() if proc is not None else None
    try:
        stream_one(url, args.api_key, "warm up", 4, args.timeout)
        print(f"server {url}, {args.requests} requests x {args.max_tokens} tokens per level, "
              f"median of {args.repeats} runs")
        print(f"{'streams':>7} {'tok/s':>8} {'p50 lat s':>10} {'p99 lat s':>10} {'p50 ttft s':>11} {'errors':>6}")
        for n in levels:
            runs = [run_level(url, args.api_key, n, args.requests, args.max_tokens, args.timeout, args.temperature)
                    for _ in range(args.repeats)]
            tps = [sum(r.tokens for r in res if r.ok) / wall for wall, res in runs]
            lat = [r.latency_s for _, res in runs for r in res if r.ok]
            ttft = [r.ttft_s for _, res in runs for r in res if r.ok]
            errors = [r.error for _, res in runs for r in res if not r.ok]
            print(f"{n:>7} {statistics.median(tps):>8.1f} {pct(lat, 0.5):>10.3f} {pct(lat, 0.99):>10.3f} "
                  f"{pct(ttft, 0.5):>11.3f} {len(errors):>6}")
            for e in sorted(set(errors))[:3]:
                print(f"        error: {e}")
            rec["rows"].append({"streams": n, "tokens_per_s": statistics.median(tps), "p50_latency_s": pct(lat, 0.5),
                                "p99_latency_s": pct(lat, 0.99), "p50_ttft_s": pct(ttft, 0.5), "errors": len(errors)})
            rec["runs"] += [{"streams": n, "repeat": i, "wall_s": wall, "tokens_per_s": tp}
                            for i, ((wall, _), tp) in enumerate(zip(runs, tps))]
        if sampler is not None:
            sampler.stop()
            mem = sampler.figures()
            rec["memory"] = mem
            gw = f", gateway {mem['gateway_peak_rss_mib']:.0f} MiB RSS" if args.replicas else ""
            print(f"memory of {mem['servers']} server process(es): peak RSS {mem['peak_rss_sum_mib']:.0f} MiB "
                  f"(sum of each one's peak), peak PSS {mem['peak_pss_mib']:.0f} MiB (shared pages once){gw}")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=120)  # replicas: the gateway first, then each replica's own shutdown
    record.write(rec, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
