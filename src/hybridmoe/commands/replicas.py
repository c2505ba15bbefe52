"""`hybridmoe replicas`: N `hybridmoe serve` replicas behind SGLang Model Gateway (`smg`), started
and stopped together.

Every replica serves under one model id (--alias) so the gateway sees one model; each is pinned to
its own physical cores (or NUMA node), and all share a --responses-dir so a `previous_response_id`
made on one is continued on another. The gateway routes each conversation to the replica whose
cache holds its prompt (`--policy cache_aware`), health-checks the replicas and retries around a
dead one. Ctrl-C or SIGTERM stops the gateway, then the replicas. docs/scale-out.md has the recipe.

    hybridmoe replicas -n 2 -- -m gpt-oss-120b-mxfp4.gguf -c 65536 -np 4
    hybridmoe replicas -n 2 --pin numa --prompt-cache-dir /var/cache/hybridmoe -- -m model.gguf
    hybridmoe replicas -n 0 --worker-url http://host-b:8081 --worker-url http://host-c:8081
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from hybridmoe.commands.cpu_sets import count_cores, format_cpus, physical_cores, replica_cpu_sets

log = logging.getLogger("hybridmoe.replicas")

# Flags the launcher sets on every replica itself; given after `--` they would make replicas collide.
OWNED_FLAGS = {"--port": "--base-port", "--host": "--replica-host", "-a": "--alias", "--alias": "--alias",
               "--prompt-cache-dir": "--prompt-cache-dir", "--responses-dir": "--responses-dir"}
STOP_TIMEOUT_S = 60.0  # a replica writes its --prompt-cache-dir at shutdown


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("replicas", help="N serve replicas behind the smg gateway (one host or several)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       allow_abbrev=False)
    p.add_argument("-n", "--replicas", type=int, default=2, help="replicas started here (default: 2)")
    p.add_argument("--host", default="127.0.0.1", help="the gateway's address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="the gateway's port (default: 8080)")
    p.add_argument("--replica-host", default="127.0.0.1",
                   help="the replicas' address (default: 127.0.0.1; 0.0.0.0 for a gateway on another host)")
    p.add_argument("--base-port", type=int, default=None, help="first replica's port (default: --port + 1)")
    p.add_argument("-a", "--alias", default="gpt-oss",
                   help="the model id every replica serves and clients ask for (default: gpt-oss)")
    p.add_argument("--pin", choices=["cores", "numa", "none"], default="cores",
                   help="cores: each replica on its own physical cores (default); numa: each on one NUMA "
                        "node's cores; none: no pinning")
    p.add_argument("--responses-dir", default=None, metavar="DIR",
                   help="stored Responses shared by the replicas (default: a temporary directory removed at exit)")
    p.add_argument("--prompt-cache-dir", default=None, metavar="DIR",
                   help="each replica keeps its prompt cache across restarts in DIR/replica-I")
    p.add_argument("--worker-url", action="append", default=[], metavar="URL",
                   help="another replica for the gateway, e.g. on another host (repeatable)")
    p.add_argument("--no-gateway", action="store_true",
                   help="start the replicas only (a host whose replicas a gateway elsewhere fronts)")
    p.add_argument("--policy", default="cache_aware", help="the gateway's routing policy (default: cache_aware)")
    p.add_argument("--metrics-port", type=int, default=29000,
                   help="the gateway's Prometheus port, on --host (default: 29000)")
    p.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                   help="passed to `smg launch` as is (repeatable; write --gateway-arg=--flag=value)")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="replica-I.log and gateway.log here (default: all output to this terminal)")
    p.add_argument("--startup-timeout", type=float, default=1800.0,
                   help="seconds to wait for each replica to load its model (default: 1800)")
    p.add_argument("serve_args", nargs=argparse.REMAINDER,
                   help="after --: `hybridmoe serve` flags for every replica (-m, -c, -np, -t, ...)")
    return p


@dataclass
class Child:
    name: str
    cmd: list[str]
    url: str
    cpus: list[int] | None = None
    proc: subprocess.Popen[bytes] | None = None
    log_file: IO[bytes] | None = field(default=None, repr=False)

    def start(self, log_dir: Path | None) -> None:
        out: IO[bytes] | None = None
        if log_dir is not None:
            out = self.log_file = open(log_dir / f"{self.name}.log", "ab")
        cpus = self.cpus

        def before_exec() -> None:  # in the child: its threads inherit the CPU set
            if cpus:
                os.sched_setaffinity(0, cpus)
            _term_with_parent()

        # Own session: Ctrl-C reaches the launcher only, which stops the gateway before the replicas.
        self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT if out else None,
                                     preexec_fn=before_exec, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _term_with_parent() -> None:
    """Linux: SIGTERM this (child) process when the launcher dies, even by SIGKILL, so no replica
    outlives it; elsewhere nothing."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def gateway_command() -> list[str] | None:
    """`smg launch` from the installed package (this interpreter's), else from PATH; None if neither."""
    if importlib.util.find_spec("smg") is not None:
        return [sys.executable, "-m", "smg", "launch"]
    exe = shutil.which("smg")
    return [exe, "launch"] if exe else None


def _flag_value(args: list[str], *names: str) -> str | None:
    """The value of the last of `names` in a serve command line (`--flag v` or `--flag=v`)."""
    value = None
    for i, word in enumerate(args):
        for name in names:
            if word == name and i + 1 < len(args):
                value = args[i + 1]
            elif word.startswith(name + "="):
                value = word[len(name) + 1:]
    return value


def first_api_key(serve_args: list[str]) -> str | None:
    """The replicas' first key (--api-key, comma-separated or not, else --api-key-file's first line):
    the one the gateway presents to them."""
    key = _flag_value(serve_args, "--api-key")
    if key:
        return key.split(",")[0].strip() or None
    path = _flag_value(serve_args, "--api-key-file")
    if path:
        try:
            lines = [ln.strip() for ln in Path(path).read_text().splitlines()]
        except OSError as e:
            raise ValueError(f"--api-key-file {path}: {e.strerror or e}") from None
        return next((ln for ln in lines if ln), None)
    return None


def check_serve_args(serve_args: list[str]) -> list[str]:
    """The flags for every replica, without the `--` separator; ValueError for one the launcher owns."""
    args = serve_args[1:] if serve_args[:1] == ["--"] else list(serve_args)
    for word in args:
        flag = word.split("=", 1)[0]
        if flag in OWNED_FLAGS:
            raise ValueError(f"{flag} is set per replica by `hybridmoe replicas`: give its {OWNED_FLAGS[flag]} "
                             "before `--` instead")
    return args


def _get(url: str, key: str | None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.status, r.read()


def wait_ready(child: Child, deadline: float, stop: threading.Event, path: str = "/health",
               expect: bytes = b"", key: str | None = None) -> bool:
    """Poll `path` until it answers 200 (with `expect` in the body); False if the process exits,
    the deadline passes or a stop is asked."""
    while time.monotonic() < deadline and not stop.is_set():
        if not child.alive():
            return False
        try:
            status, body = _get(child.url + path, key)
            if status == 200 and expect in body:
                return True
        except (urllib.error.URLError, OSError):
            pass
        stop.wait(0.5)
    return False


def stop_all(children: list[Child], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM each (the gateway first, then every replica at once); SIGKILL what is left at the timeout."""
    for group in ([c for c in children if c.name == "gateway"], [c for c in children if c.name != "gateway"]):
        for c in group:
            if c.alive():
                assert c.proc is not None
                c.proc.terminate()
        deadline = time.monotonic() + timeout_s
        for c in group:
            if c.proc is None:
                continue
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s: killed", c.name, timeout_s)
                c.proc.kill()
                c.proc.wait(timeout=10)
    for c in children:
        if c.log_file is not None:
            c.log_file.close()


def plan_children(args: argparse.Namespace, serve_args: list[str], responses_dir: str) -> list[Child]:
    """The replicas' and the gateway's command lines (nothing started)."""
    n = args.replicas
    base = args.base_port if args.base_port is not None else args.port + 1
    cpu_sets: list[list[int] | None] = [None] * n
    threads_given = _flag_value(serve_args, "-t", "--threads") is not None
    cores = physical_cores(sorted(os.sched_getaffinity(0)))
    if args.pin != "none" and n > 0:
        cpu_sets = list(replica_cpu_sets(n, args.pin, cores))
    children = []
    for i in range(n):
        port = base + i
        cmd = [sys.executable, "-m", "hybridmoe.cli", "serve", *serve_args, "--host", args.replica_host,
               "--port", str(port), "--alias", args.alias, "--responses-dir", responses_dir]
        cpus = cpu_sets[i]
        if cpus and not threads_given:
            cmd += ["-t", str(count_cores(cpus, cores))]
        if args.prompt_cache_dir:
            cmd += ["--prompt-cache-dir", str(Path(args.prompt_cache_dir) / f"replica-{i}")]
        host = "127.0.0.1" if args.replica_host in ("0.0.0.0", "::", "") else args.replica_host
        children.append(Child(f"replica-{i}", cmd, f"http://{host}:{port}", cpus))
    if not args.no_gateway:
        smg = gateway_command()
        if smg is None:
            raise ValueError("the gateway is not installed: `pip install smg` (SGLang Model Gateway), "
                             "or start the replicas alone with --no-gateway")
        workers = [c.url for c in children] + list(args.worker_url)
        if not workers:
            raise ValueError("no replicas for the gateway: -n 0 needs --worker-url")
        cmd = [*smg, "--host", args.host, "--port", str(args.port), "--worker-urls", *workers,
               "--policy", args.policy, "--prometheus-host", args.host, "--prometheus-port", str(args.metrics_port),
               "--shutdown-grace-period-secs", "5"]
        key = first_api_key(serve_args)
        if key:  # the gateway presents it to the replicas and asks clients for it
            cmd += ["--api-key", key]
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
        children.append(Child("gateway", cmd + list(args.gateway_arg), f"http://{host}:{args.port}"))
    return children


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s hybridmoe replicas: %(message)s")
    serve_args = check_serve_args(args.serve_args)
    if args.replicas < 0 or (args.replicas == 0 and args.no_gateway):
        raise ValueError(f"-n {args.replicas}: nothing to start (-n 0 is for a gateway with --worker-url)")
    own_dir = args.responses_dir is None
    responses_dir = tempfile.mkdtemp(prefix="hybridmoe-responses-") if own_dir else args.responses_dir
    log_dir = Path(args.log_dir) if args.log_dir else None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    got: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        got.append(signum)
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    children: list[Child] = []
    try:
        children = plan_children(args, serve_args, responses_dir)
        replicas = [c for c in children if c.name != "gateway"]
        gateway = next((c for c in children if c.name == "gateway"), None)
        for c in replicas:
            c.start(log_dir)
            log.info("%s: %s%s", c.name, c.url, f" on CPUs {format_cpus(c.cpus)}" if c.cpus else "")
        deadline = time.monotonic() + args.startup_timeout
        for c in replicas:
            if not wait_ready(c, deadline, stop):
                if stop.is_set():
                    return 130 if signal.SIGINT in got else 0
                why = "exited" if not c.alive() else f"is not healthy after {args.startup_timeout:.0f} s"
                log.error("%s %s; stopping everything", c.name, why)
                return 1
        if gateway is not None:
            gateway.start(log_dir)
            # Ready once it has registered a replica: its model list then names the alias.
            model = f'"{args.alias}"'.encode()
            if not wait_ready(gateway, time.monotonic() + 120, stop, "/v1/models", model, first_api_key(serve_args)):
                if stop.is_set():
                    return 130 if signal.SIGINT in got else 0
                log.error("the gateway did not come up serving %r; stopping everything", args.alias)
                return 1
            log.info("gateway: %s/v1 serving model %r from %d replica(s)", gateway.url, args.alias,
                     len(replicas) + len(args.worker_url))
        return _supervise(children, gateway, stop, got)
    finally:
        if got and children:
            log.info("stopping the gateway and the replicas")
        stop_all(children)
        for s, h in old.items():
            signal.signal(s, h)
        if own_dir:
            shutil.rmtree(responses_dir, ignore_errors=True)


def _supervise(children: list[Child], gateway: Child | None, stop: threading.Event, got: list[int]) -> int:
    """Until a signal or the gateway's exit: a replica that dies is reported once (the gateway
    routes around it); with no gateway, the launcher ends when every replica has."""
    reported: set[str] = set()
    while not stop.wait(1.0):
        if gateway is not None and not gateway.alive():
            log.error("the gateway exited (%s); stopping the replicas", gateway.proc.returncode if gateway.proc else "?")
            return 1
        for c in children:
            if c is not gateway and not c.alive() and c.name not in reported:
                reported.add(c.name)
                log.warning("%s exited (%s); the gateway serves from the others", c.name,
                            c.proc.returncode if c.proc else "?")
        if gateway is None and all(not c.alive() for c in children):
            return 1
    return 130 if signal.SIGINT in got else 0
