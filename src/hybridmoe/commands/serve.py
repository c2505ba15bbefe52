"""`hybridmoe serve`: an OpenAI-compatible server taking llama-server's flag names.

The model file is checked and the port bound first (a bad file or a busy port fails at once, in
one line); then /health says 503 "Loading model" while the model loads in a thread.
llama-server flags that mean nothing here are accepted with a warning, so existing command
lines keep working.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

from hybridmoe.tokenizer.builtin_templates import BUILTIN_TEMPLATES, resolve_chat_template

log = logging.getLogger("hybridmoe.serve")

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


def _size(value: str) -> int:
    from hybridmoe.server.limits import parse_size

    try:
        return parse_size(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (llama-server flags)",
        description=__doc__,
        allow_abbrev=False,  # an unknown llama-server flag must never match one of ours by prefix
    )
    a = p.add_argument
    a("-m", "--model", default=None, help="GGUF file (first part of a split model); default: bundled demo")
    a("--host", default="127.0.0.1", help="address(es) to listen on, comma-separated (UNIX socket: a path "
                                          "ending in .sock); with several, :: binds IPv6 only")
    a("--port", type=int, default=8080)
    a("--api-key", action="append", default=[], help="accepted key (repeatable; comma-separated allowed)")
    a("--api-key-file", default=None, help="file with one API key per line")
    a("-a", "--alias", default=None, help="model name(s), comma-separated: /v1/models id and aliases")
    a("--tags", default=None, help="model tags, comma-separated (informational, listed by /v1/models)")
    a("-c", "--ctx-size", type=int, default=0, help="total context, split across slots (0 = the model's)")
    a("-np", "--parallel", type=int, default=4, help="slots (concurrent sequences)")
    a("-t", "--threads", type=int, default=None)
    a("-b", "--batch-size", type=int, default=2048, help="logical batch: max prompt tokens per step")
    a("-ub", "--ubatch-size", type=int, default=512, help="physical batch; a step feeds min(-b, -ub) prompt tokens")
    a("-fa", "--flash-attn", nargs="?", const="on", default="auto", type=_on_off)
    a("-ngl", "--n-gpu-layers", "--gpu-layers", type=int, default=None)
    a("--cpu-moe", "-cmoe", action="store_true", help="keep every expert tensor on the CPU")
    a("--n-cpu-moe", "-ncmoe", type=int, default=None, help="experts of the first N layers on the CPU")
    a("-ot", "--override-tensor", action="append", default=[], help="REGEX=DEVICE[,...] (repeatable)")
    a("--fit", nargs="?", const="on", default=None, type=_on_off, help="choose placement to fit VRAM")
    a("--vram-budget", type=float, default=None, help="GiB of VRAM the plan may use")
    a("--fast-math", action="store_true",
      help="int8 activations (decode, and MXFP4 experts in prompts): faster, ~5e-3 relative error "
           "per matmul (default: exact fp32)")
    a("--upload-slots", type=int, default=None,
      help="GPU buffers of one layer's CPU experts for prompt batches (0 = compute them on the CPU)")
    a("--gpu-dense-dtype", default=None, choices=["auto", "stored", "bf16", "f16", "f32"],
      help="Q8_0 non-expert weights on the GPU: bf16 when it fits (auto), or as stored")
    a("--jinja", action="store_true", help="accepted; the GGUF's Jinja template is always used")
    a("--chat-template-file", default=None)
    a("--chat-template", default=None,
      help=f"a built-in template name ({', '.join(sorted(BUILTIN_TEMPLATES))}) or a Jinja template")
    a("--reasoning-format", choices=["none", "auto", "deepseek"], default="auto")
    a("-rea", "--reasoning", default="auto", type=_on_off,
      help="reasoning in chats: on, off (harmony replies skip the analysis channel) or auto; the "
           "template's enable_thinking")
    a("--chat-template-kwargs", type=_json_object, default=None)
    a("-s", "--seed", type=int, default=-1, help="RNG seed of requests that give none (-1: random)")
    a("-n", "--predict", "--n-predict", dest="n_predict", type=int, default=-1,
      help="token limit of requests that give none (-1: up to the context)")
    a("--temp", type=float, default=0.8)
    a("--top-k", type=int, default=40)
    a("--top-p", type=float, default=0.95)
    a("--min-p", type=float, default=0.05)
    a("--mlock", action="store_true")
    a("--no-mmap", action="store_true")
    a("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints", type=int, default=32,
      help="sliding-window checkpoints kept per slot, for prompts that diverge before the end of what is cached")
    a("-cms", "--checkpoint-min-step", type=int, default=2048,
      help="a checkpoint every N tokens inside a long prompt (one is always taken at the prompt's end)")
    a("-cram", "--cache-ram", type=int, default=None,
      help="MiB of RAM for prompts whose slot went to another conversation (-1 = no limit, 0 = off; "
           "default: 8192 or a quarter of the available RAM, whichever is less)")
    a("--cache-idle-slots", action=argparse.BooleanOptionalAction, default=True,
      help="accepted (always on): a slot's state moves to the RAM cache when another prompt takes the slot")
    a("--slot-save-path", default=None, help="directory for POST /slots/{id}?action=save|restore files")
    a("--metrics", action="store_true", help="enable the Prometheus /metrics endpoint")
    a("--slots", dest="slots", action="store_true", default=True, help="expose /slots (default)")
    a("--no-slots", dest="slots", action="store_false", help="/slots answers 501")
    a("-v", "--verbose", "--log-verbose", action="store_true",
      help="debug logging; responses carry llama-server's __verbose field")
    a("--swa-full", action="store_true", help="full-size KV cache for sliding-window layers (longer prefix reuse)")
    a("--context-shift", dest="context_shift", action="store_true", default=False,
      help="accepted; see the README (gpt-oss needs --swa-full for it in llama.cpp too)")
    a("--no-context-shift", dest="context_shift", action="store_false")
    a("--cors-origins", default="*", help="allowed origins: * (echo any), localhost, or a comma-separated list")
    a("--cors-methods", default="GET, POST, DELETE, OPTIONS")
    a("--cors-headers", default="*", help="allowed headers (* = those the browser asks for)")
    a("--cors-credentials", dest="cors_credentials", action="store_true", default=True)
    a("--no-cors-credentials", dest="cors_credentials", action="store_false")
    a("--max-queue", type=int, default=64, help="requests that may wait for a slot before 503")
    a("--max-body-size", type=_size, default=None,
      help="largest request body in bytes, k/M/G suffix allowed (default 8M); larger ones get 413")
    a("--shutdown-grace", type=float, default=5.0,
      help="seconds in-flight requests may run on after SIGTERM before they are ended (default 5)")
    # Test hook: honour the request field `test_forced_output` (text whose tokens replace the sampled
    # ones), so harmony reasoning/tool-call paths can be tested through a server with a random model.
    a("--test-hooks", action="store_true", help=argparse.SUPPRESS)
    _accept_unknown(p)
    return p


def _accept_unknown(p: argparse.ArgumentParser) -> None:
    """Make this subparser keep unknown flags in `args.unknown_flags` instead of failing.

    llama-server short flags such as `-ctk q8_0` or `-tb 8` would otherwise be read by argparse
    as `-c tk` / `-t b`; llama-server never glues values to short flags, so single-dash words that
    are not ours are set aside (with the value after them) before argparse sees them.
    """
    parse = p.parse_known_args
    ours = {s for action in p._actions for s in action.option_strings}

    def lenient(args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        args = list(sys.argv[1:] if args is None else args)
        kept: list[str] = []
        unknown: list[str] = []
        i = 0
        while i < len(args):
            word = args[i]
            if len(word) > 2 and word[0] == "-" and word[1] != "-" and word not in ours and not _is_number(word):
                unknown.append(word)
                if i + 1 < len(args) and not args[i + 1].startswith("-"):
                    unknown.append(args[i + 1])
                    i += 1
            else:
                kept.append(word)
            i += 1
        ns, extra = parse(kept, namespace)
        ns.unknown_flags = list(getattr(ns, "unknown_flags", [])) + unknown + extra
        return ns, []

    p.parse_known_args = lenient  # type: ignore[method-assign]


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


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
        from hybridmoe.gguf.validate import check_regular_file

        try:
            check_regular_file(args.model)  # not found / a directory / a FIFO / a device, said as such
        except ValueError as e:
            raise SystemExit(f"hybridmoe serve: error: {e}") from None
        return args.model, False
    from hybridmoe.engine.llm import DEMO_MODEL, resolve_model_path

    return resolve_model_path(None), not DEMO_MODEL.is_file()


def _placement(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {"n_parallel": max(1, args.parallel)}  # the plan sizes sliding-window KV per slot
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
    if args.gpu_dense_dtype is not None:
        opts["gpu_dense_dtype"] = args.gpu_dense_dtype
    if args.upload_slots is not None:
        opts["upload_slots"] = args.upload_slots
    return opts


def _cache_config(args: argparse.Namespace) -> Any:
    """Prompt-reuse settings; the RAM cache's default stays small beside the page cache that holds
    the mmap'd experts."""
    from hybridmoe.engine.engine import CacheConfig
    from hybridmoe.placement.memory import available_ram_bytes

    if args.cache_ram is None:
        avail = available_ram_bytes()
        limit: int | None = min(8192 * 2**20, avail // 4) if avail else 8192 * 2**20
    else:
        limit = None if args.cache_ram < 0 else args.cache_ram * 2**20
    log.info("prompt cache: %s in RAM, %d checkpoints per slot",
             "no limit" if limit is None else f"{limit / 2**20:.0f} MiB", args.ctx_checkpoints)
    return CacheConfig(ctx_checkpoints=max(0, args.ctx_checkpoints), checkpoint_every=max(1, args.checkpoint_min_step),
                       cache_ram_bytes=limit)


def _preflight(args: argparse.Namespace, path: str) -> None:
    """Header, metadata values and context size checked before the port is bound and before torch
    is imported: a damaged file fails in a second, in one line (GGUFError / ValueError)."""
    from hybridmoe.gguf.reader import open_model
    from hybridmoe.models.gpt_oss_config import GptOssConfig
    from hybridmoe.server.limits import check_template_kwargs

    if args.port is not None and not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} is not a TCP port (0-65535)")
    if args.chat_template_kwargs:
        try:
            check_template_kwargs(args.chat_template_kwargs, "--chat-template-kwargs")
        except Exception as e:  # an APIError: say it as a command-line error
            raise ValueError(str(e)) from None
    if args.ctx_size < 0:
        raise ValueError(f"-c {args.ctx_size}: the context size must be >= 0 (0 = the model's)")
    mf = open_model(path)
    try:
        GptOssConfig.from_metadata(mf.metadata, mf.path)
    finally:
        mf.close()


def _chat_template(args: argparse.Namespace) -> str | None:
    """--chat-template-file wins over --chat-template (a built-in name or Jinja), as llama-server."""
    if args.chat_template_file:
        return Path(args.chat_template_file).read_text()
    if args.chat_template:
        return resolve_chat_template(args.chat_template)
    return None


def _load(args: argparse.Namespace, path: str, state: Any, server: Any) -> None:
    """Model loading thread: LLM -> Engine -> Serving, then /health turns 200. On failure the
    server stops and `serve` exits 1, as llama-server does (no half-alive process)."""
    from hybridmoe.engine.engine import Engine
    from hybridmoe.engine.llm import LLM
    from hybridmoe.server.serving import SamplingDefaults, Serving, ServingConfig

    try:
        step_tokens = max(1, min(args.batch_size, args.ubatch_size))  # as llama.cpp: ub bounds one compute
        llm = LLM(path, threads=args.threads, ctx_size=args.ctx_size, batch_size=step_tokens,
                  mlock=args.mlock, fast_math=args.fast_math, **_placement(args))
        n_parallel = max(1, args.parallel)
        per_slot = llm.ctx_size // n_parallel
        if args.swa_full:
            llm.model.use_full_swa_cache()
        engine = Engine(llm, n_parallel, per_slot, args.max_queue, batch_size=step_tokens,
                        cache=_cache_config(args)).start()
        config = ServingConfig(
            model_path=path,
            alias=args.alias,
            tags=[t.strip() for t in (args.tags or "").split(",") if t.strip()],
            reasoning_format=args.reasoning_format,
            reasoning=args.reasoning,
            chat_template=_chat_template(args),
            chat_template_kwargs=args.chat_template_kwargs or {},
            defaults=SamplingDefaults(args.temp, args.top_k, args.top_p, args.min_p),
            seed=None if args.seed < 0 else args.seed,
            n_predict=args.n_predict,
            verbose=args.verbose,
            test_hooks=args.test_hooks,
            slot_save_path=args.slot_save_path,
        )
        state.serving = Serving(engine, config)
        log.info("model loaded: %s (%d slots x %d tokens of context)", path, n_parallel, per_slot)
    except Exception as e:
        log.debug("load failure", exc_info=True)
        log.error("model failed to load: %s: %s", type(e).__name__, e)
        state.load_error = f"{type(e).__name__}: {e}"
        server.should_exit = True


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.captureWarnings(True)  # e.g. "no CUDA device: ... run on the CPU" from placement
    for flag in getattr(args, "unknown_flags", []):
        if flag.startswith("-"):
            log.warning("ignoring flag %s: it has no meaning in hybridmoe", flag)
    if args.no_mmap:
        log.warning("--no-mmap is accepted but has no effect: experts are always used in place from the mmap "
                    "(use --mlock to pin them in RAM)")
    if args.slot_save_path:
        try:
            os.makedirs(args.slot_save_path, exist_ok=True)
        except OSError as e:
            raise SystemExit(f"hybridmoe serve: --slot-save-path {args.slot_save_path}: {e.strerror or e}") from None
    if args.chat_template and not args.chat_template_file:
        try:
            resolve_chat_template(args.chat_template)
        except ValueError as e:
            raise SystemExit(f"hybridmoe serve: --chat-template: {e}") from None
    if args.context_shift:
        # llama.cpp disables it for gpt-oss unless --swa-full (its sliding-window cache cannot shift).
        log.warning("--context-shift: context shift is not supported by this server, it will be disabled "
                    "(generation stops at the end of the context with finish_reason \"length\")")
    path, is_random = _model_path(args)
    if is_random:
        log.warning("no bundled demo model in this build: serving a RANDOM synthetic model (%s); its output is "
                    "noise. Pass -m FILE for a real model.", path)
    _preflight(args, path)
    keys = _api_keys(args)
    from hybridmoe.server.listen import describe_socket, listen_sockets

    sockets = listen_sockets(args.host, args.port)

    import uvicorn

    from hybridmoe.server.app import ServerState, create_app
    from hybridmoe.server.cors import CorsConfig
    from hybridmoe.server.graceful import GracefulServer

    cors = CorsConfig(origins=args.cors_origins, methods=args.cors_methods, headers=args.cors_headers,
                      credentials=args.cors_credentials)
    state = ServerState(api_keys=keys, metrics_enabled=args.metrics, slots_enabled=args.slots, cors=cors)
    if args.max_body_size is not None:
        state.max_body_bytes = args.max_body_size
    app = create_app(state)
    grace = max(0.0, args.shutdown_grace)
    config = uvicorn.Config(app, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=grace + GracefulServer.FINAL_EVENT_SECONDS)
    server = GracefulServer(config, grace, state)
    loader = threading.Thread(target=_load, args=(args, path, state, server), name="hybridmoe-load", daemon=True)
    loader.start()
    for sock in sockets:
        print(f"hybridmoe: listening on {describe_socket(sock)} (model {path})", flush=True)
    server.run(sockets=sockets)
    if state.serving is not None:
        state.serving.engine.close()
    code = 1 if state.load_error else 0
    if loader.is_alive():
        # Stopped while loading: the loader's native threads cannot be joined, and C++ destructors
        # of running threads abort at exit. Leave without running them.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
