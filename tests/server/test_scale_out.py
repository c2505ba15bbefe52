"""Two replicas of the demo model behind SGLang Model Gateway (`smg`), started by `hybridmoe replicas`
on loopback, as docs/scale-out.md tells users to run them: conversations keep their cache through the
gateway, both replicas serve, `previous_response_id` chains cross replicas, and a replica killed
mid-stream hangs nothing. Skipped when `smg` is not installed (it is in the test extras)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.server.conftest import free_port

pytest.importorskip("smg", reason="smg (SGLang Model Gateway) is not installed: `pip install smg` "
                                  "(in hybridmoe's test extras)")
DEMO = Path(__file__).resolve().parents[2] / "src" / "hybridmoe" / "data" / "demo.gguf"
pytestmark = pytest.mark.skipif(not DEMO.exists(), reason="demo.gguf not built (see demo/README.md)")

ALIAS = "gpt-oss"
READY_TIMEOUT_S = 90
REQUEST_TIMEOUT_S = 30


def _free_pair() -> int:
    """A port p with p + 1 free as well (the replicas' --base-port)."""
    for _ in range(50):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no two consecutive free ports")


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@dataclass
class Deployment:
    launcher: subprocess.Popen[bytes]
    gateway: str
    replicas: list[str]
    pids: dict[str, int]  # replica URL -> pid
    logs: Path

    def log(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in sorted(self.logs.iterdir()))


def post(url: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, dict | str, str | None]:
    """(status, JSON or text, the replica the gateway says served it)."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            return r.status, json.loads(r.read()), r.headers.get("x-smg-routed-worker-id")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace"), None


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    logs = tmp_path_factory.mktemp("scale_out_logs")
    base = _free_pair()
    port, metrics = free_port(), free_port()
    while len({port, metrics, base, base + 1}) < 4:
        port, metrics = free_port(), free_port()
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []  # a shared 2-core CI machine
    cmd = [*nice, sys.executable, "-m", "hybridmoe.cli", "replicas", "-n", "2", "--port", str(port),
           "--base-port", str(base), "--metrics-port", str(metrics), "--log-dir", str(logs), "--pin", "none",
           "--gateway-arg=--load-monitor-interval=2",
           "--", "-m", str(DEMO), "-t", "1", "-c", "8192", "-np", "4", "--metrics"]
    out = open(logs / "launcher.log", "wb")
    launcher = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    gateway = f"http://127.0.0.1:{port}"
    replicas = [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
    started: set[int] = set()
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            assert launcher.poll() is None, (logs / "launcher.log").read_text()
            assert time.monotonic() < deadline, "the gateway never listed the model"
            started.update(_children(launcher.pid))
            try:
                with urllib.request.urlopen(gateway + "/v1/models", timeout=5) as r:
                    if f'"{ALIAS}"' in r.read().decode():
                        break
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        pids = {}
        for pid in _children(launcher.pid):
            started.add(pid)
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            for url in replicas:
                if url.rsplit(":", 1)[1].encode() in argv and b"serve" in argv:
                    pids[url] = pid
        assert len(pids) == 2, pids
        yield Deployment(launcher, gateway, replicas, pids, logs)
    finally:
        launcher.send_signal(signal.SIGTERM)
        try:
            assert launcher.wait(timeout=60) == 0
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait(timeout=10)
        finally:
            for pid in started:  # never leave a replica or the gateway behind the launcher
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes()
                    if b"hybridmoe" in argv or b"smg" in argv:  # still ours, not a reused pid
                        os.kill(pid, signal.SIGKILL)
                except (OSError, ProcessLookupError):
                    pass
            out.close()


FIRST = "Conversation {c}: the book of Psalms is a collection of songs and prayers, number {c}. " * 10


def test_interleaved_conversations_reuse_their_cache_through_the_gateway(deployment: Deployment):
    """Four conversations take turns at once; each turn resends the conversation, and the replica
    the gateway picks must already hold >= 90% of it (the previous turn's whole prompt)."""
    convs = {c: [{"role": "user", "content": FIRST.format(c=c)}] for c in "ABCD"}
    turns: dict[str, list[tuple[int, int, str | None]]] = {c: [] for c in convs}
    errors: list[str] = []

    def turn(c: str, barrier: threading.Barrier) -> None:
        barrier.wait(timeout=REQUEST_TIMEOUT_S)
        # The first turns overlap (longer replies), so the gateway sees the replicas busy and spreads them.
        body = {"model": ALIAS, "messages": convs[c], "max_tokens": 48 if not turns[c] else 24, "temperature": 0}
        status, r, who = post(deployment.gateway + "/v1/chat/completions", body)
        if status != 200 or not isinstance(r, dict):
            errors.append(f"{c}: {status} {r}")
            return
        usage = r["usage"]
        if usage["prompt_tokens_details"]["cached_tokens"] != r["timings"]["cache_n"]:
            errors.append(f"{c}: usage and timings disagree: {usage} {r['timings']}")
        turns[c].append((usage["prompt_tokens"], r["timings"]["cache_n"], who))
        convs[c] += [{"role": "assistant", "content": r["choices"][0]["message"]["content"] or "..."},
                     {"role": "user", "content": f"Tell me more about number {c}, turn {len(turns[c])}."}]

    for _ in range(4):
        barrier = threading.Barrier(len(convs))
        threads = [threading.Thread(target=turn, args=(c, barrier)) for c in convs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=2 * REQUEST_TIMEOUT_S)
        assert not errors, errors
    for c, ts in turns.items():
        for (prev_n, _, _), (n, cached, who) in zip(ts, ts[1:]):
            assert n > prev_n and cached >= 0.9 * prev_n, (c, ts, deployment.log())
    served = {who for ts in turns.values() for _, _, who in ts}
    assert served == set(deployment.replicas), (turns, deployment.log())


def test_previous_response_id_chains_work_across_replicas(deployment: Deployment):
    """Through the gateway (which forwards the id as it is) every turn finds its history, whichever
    replica gets it: the replicas share --responses-dir. Directly, a chain started on one replica
    goes on on the other."""
    for c in "ABC":
        status, r, _ = post(deployment.gateway + "/v1/responses",
                            {"model": ALIAS, "input": f"Chain {c} begins here.", "max_output_tokens": 8})
        assert status == 200, r
        prev_in = r["usage"]["input_tokens"]
        for i in range(3):
            status, r, _ = post(deployment.gateway + "/v1/responses",
                                {"model": ALIAS, "input": f"more {i}", "previous_response_id": r["id"],
                                 "max_output_tokens": 8})
            assert status == 200, r
            assert r["previous_response_id"] and r["usage"]["input_tokens"] > prev_in
            prev_in = r["usage"]["input_tokens"]
    one, two = deployment.replicas
    status, r, _ = post(one + "/v1/responses", {"model": ALIAS, "input": "Started on one.", "max_output_tokens": 8})
    assert status == 200, r
    status, r2, _ = post(two + "/v1/responses", {"model": ALIAS, "input": "Went on on two.",
                                                 "previous_response_id": r["id"], "max_output_tokens": 8})
    assert status == 200 and r2["usage"]["input_tokens"] > r["usage"]["input_tokens"], r2


def test_gateway_reads_the_replicas_loads(deployment: Deployment):
    """/v1/loads in SGLang's shape is what the gateway polls; its own /get_loads echoes each replica."""
    with urllib.request.urlopen(deployment.replicas[0] + "/v1/loads", timeout=10) as r:
        own = json.loads(r.read())
    assert own["loads"][0]["max_running_requests"] == 4 and own["loads"][0]["max_total_num_tokens"] == 8192
    deadline = time.monotonic() + 30  # the gateway polls every 10 s
    while True:
        with urllib.request.urlopen(deployment.gateway + "/get_loads", timeout=10) as r:
            seen = {x["worker"]: x for x in json.loads(r.read())["loads"]}
        if set(deployment.replicas) <= set(seen) and all(seen[u]["max_total_num_tokens"] == 8192
                                                         for u in deployment.replicas):
            break
        assert time.monotonic() < deadline, seen
        time.sleep(1)


def test_a_replica_killed_mid_stream_hangs_nothing(deployment: Deployment):
    """Runs last (it kills a replica): the stream it served ends at once, the next requests are
    served by the other, conversations included."""
    body = {"model": ALIAS, "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 1500,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(deployment.gateway + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.monotonic()
    events, finished, victim = 0, False, None
    try:
        with urllib.request.urlopen(req, timeout=10) as r:  # a read waiting 10 s is a hang
            victim = r.headers.get("x-smg-routed-worker-id")
            assert victim in deployment.pids
            for line in r:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                events += 1
                chunk = json.loads(line[6:])
                finished = finished or any(ch.get("finish_reason") for ch in chunk.get("choices", []))
                if events == 3:
                    assert not finished
                    os.kill(deployment.pids[victim], signal.SIGKILL)
    except (urllib.error.URLError, OSError, ValueError):
        pass  # a cut stream may end in an error: what matters is that it ends
    assert victim is not None and events >= 3 and not finished
    assert time.monotonic() - t0 < 10
    survivor = next(u for u in deployment.replicas if u != victim)
    for i in range(4):
        t = time.monotonic()
        status, r, who = post(deployment.gateway + "/v1/chat/completions",
                              {"model": ALIAS, "messages": [{"role": "user", "content": FIRST.format(c=f"after {i}")}],
                               "max_tokens": 8})
        assert status == 200 and who == survivor, (status, r, who)
        assert time.monotonic() - t < REQUEST_TIMEOUT_S
