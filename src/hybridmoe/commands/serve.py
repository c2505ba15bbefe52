"""`hybridmoe serve`: an OpenAI-compatible server taking llama-server's flag names.

The HTTP socket opens at once (/health says 503 "Loading model"); the model loads in a thread.
llama-server flags that mean nothing here are accepted with a warning, so existing command
lines keep working.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger("hybridmoe.serve")

DEMO_PATH = Path(__file__).resolve().parent.parent / "data" / "demo.gguf"


def _on_off(value: str) -> str:
    v = value.lower()
    if v not in ("on", "off", "auto", "1", "0", "true", "false"):
        raise argparse.ArgumentTypeError(f"expected on, off or auto, got {value!r}")
    return {"1": "on", "true": "on", "0": "off", "false": "off"}.get(v, v)


def _json_object(value: str) -> dict[str, Any]:
    try:
        obj = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return obj


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (llama-server flags)",
        description=__doc__,
        allow_abbrev=False,  # an unknown llama-server flag must never match one of ours by prefix
    )
    a = p.add_argument
    a("-m", "--model", default=None, help="GGUF file (first part of a split model); default: bundled demo")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=8080)
    a("--api-key", action="append", default=[], help="accepted key (repeatable; comma-separated allowed)")
    a("--api-key-file", default=None, help="file with one API key per line")
    a("-a", "--alias", default=None, help="model id reported by /v1/models")
    a("-c", "--ctx-size", type=int, default=0, help="total context, split across slots (0 = the model's)")
    a("-np", "--parallel", type=int, default=4, help="slots (concurrent sequences)")
    a("-t", "--threads", type=int, default=None)
    a("-b", "--batch-size", type=int, default=2048, help="max prompt tokens per engine step")
    a("-ub", "--ubatch-size", type=int, default=512)
    a("-fa", "--flash-attn", nargs="?", const="on", default="auto", type=_on_off)
    a("-ngl", "--n-gpu-layers", "--gpu-layers", type=int, default=None)
    a("--cpu-moe", "-cmoe", action="store_true", help="keep every expert tensor on the CPU")
    a("--n-cpu-moe", "-ncmoe", type=int, default=None, help="experts of the first N layers on the CPU")
    a("-ot", "--override-tensor", action="append", default=[], help="REGEX=DEVICE[,...] (repeatable)")
    a("--fit", nargs="?", const="on", default=None, type=_on_off, help="choose placement to fit VRAM")
    a("--vram-budget", type=float, default=None, help="GiB of VRAM the plan may use")
    a("--jinja", action="store_true", help="accepted; the GGUF's Jinja template is always used")
    a("--chat-template-file", default=None)
    a("--reasoning-format", choices=["none", "auto", "deepseek"], default="auto")
    a("--chat-template-kwargs", type=_json_object, default=None)
    a("--temp", type=float, default=0.8)
    a("--top-k", type=int, default=40)
    a("--top-p", type=float, default=0.95)
    a("--min-p", type=float, default=0.05)
    a("--mlock", action="store_true")
    a("--no-mmap", action="store_true")
    a("--metrics", action="store_true", help="enable the Prometheus /metrics endpoint")
    a("--max-queue", type=int, default=64, help="requests that may wait for a slot before 503")
    # Test hook: every request's output is these (harmony) tokens; exercises tool calls with a random model.
    a("--test-forced-output", default=None, help=argparse.SUPPRESS)
    _accept_unknown(p)
    return p


def _accept_unknown(p: argparse.ArgumentParser) -> None:
    """Make this subparser keep unknown flags in `args.unknown_flags` instead of failing."""
    parse = p.parse_known_args

    def lenient(args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        ns, extra = parse(args, namespace)
        ns.unknown_flags = list(getattr(ns, "unknown_flags", [])) + extra
        return ns, []

    p.parse_known_args = lenient  # type: ignore[method-assign]


def _api_keys(args: argparse.Namespace) -> list[str]:
    keys = [k.strip() for arg in args.api_key for k in arg.split(",") if k.strip()]
    env = os.environ.get("LLAMA_API_KEY")
    if env and not keys:
        keys.append(env)
    if args.api_key_file:
        keys += [ln.strip() for ln in Path(args.api_key_file).read_text().splitlines() if ln.strip()]
    return keys


def _model_path(args: argparse.Namespace) -> tuple[str, bool]:
    """(path, is_random): the given file, the bundled demo, or a synthetic tiny model made once."""
    if args.model:
        if not Path(args.model).is_file():
            raise SystemExit(f"hybridmoe serve: model file not found: {args.model}")
        return args.model, False
    if DEMO_PATH.is_file():
        return str(DEMO_PATH), False
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hybridmoe"
    out = cache / "synthetic-tiny.gguf"
    if not out.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp.gguf")
        cmd = [sys.executable, "-m", "hybridmoe.cli", "synth", "--preset", "tiny", "--out", str(tmp)]
        subprocess.run(cmd, check=True)
        tmp.replace(out)
    return str(out), True


def _placement(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if args.n_gpu_layers is not None:
        opts["n_gpu_layers"] = args.n_gpu_layers
    if args.cpu_moe:
        opts["cpu_moe"] = True
    if args.n_cpu_moe is not None:
        opts["n_cpu_moe"] = args.n_cpu_moe
    if args.override_tensor:
        opts["override_tensor"] = [r for arg in args.override_tensor for r in arg.split(",") if r]
    if args.fit is not None:
        opts["fit"] = args.fit == "on"
    if args.vram_budget is not None:
        opts["vram_budget"] = args.vram_budget
    return opts


def _load(args: argparse.Namespace, path: str, state: Any) -> None:
    """Model loading thread: LLM -> Engine -> Serving, then /health turns 200."""
    from hybridmoe.engine.engine import Engine
    from hybridmoe.engine.llm import LLM
    from hybridmoe.server.serving import SamplingDefaults, Serving, ServingConfig

    try:
        llm = LLM(path, threads=args.threads, ctx_size=args.ctx_size, **_placement(args))
        n_parallel = max(1, args.parallel)
        per_slot = llm.ctx_size // n_parallel
        engine = Engine(llm, n_parallel, per_slot, args.max_queue, batch_size=args.batch_size).start()
        template = Path(args.chat_template_file).read_text() if args.chat_template_file else None
        config = ServingConfig(
            model_path=path,
            alias=args.alias,
            reasoning_format=args.reasoning_format,
            chat_template=template,
            chat_template_kwargs=args.chat_template_kwargs or {},
            defaults=SamplingDefaults(args.temp, args.top_k, args.top_p, args.min_p),
            forced_output=args.test_forced_output,
        )
        state.serving = Serving(engine, llm, config)
        log.info("model loaded: %s (%d slots x %d tokens of context)", path, n_parallel, per_slot)
    except Exception as e:  # keep the socket up so /health can say why
        log.exception("model failed to load")
        state.load_error = f"{type(e).__name__}: {e}"


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from hybridmoe.server.app import ServerState, create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for flag in getattr(args, "unknown_flags", []):
        if flag.startswith("-"):
            log.warning("ignoring flag %s: it has no meaning in hybridmoe", flag)
    if args.mlock or args.no_mmap:
        log.warning("--mlock/--no-mmap are accepted but have no effect: experts are always used from the mmap")
    path, is_random = _model_path(args)
    if is_random:
        log.warning("no bundled demo model in this build: serving a RANDOM synthetic model (%s); its output is "
                    "noise. Pass -m FILE for a real model.", path)
    keys = _api_keys(args)
    state = ServerState(api_keys=keys, metrics_enabled=args.metrics)
    app = create_app(state)
    threading.Thread(target=_load, args=(args, path, state), name="hybridmoe-load", daemon=True).start()
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    print(f"hybridmoe: listening on http://{args.host}:{args.port} (model {path})", flush=True)
    server.run()
    if state.serving is not None:
        state.serving.engine.close()
    return 0
