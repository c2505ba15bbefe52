"""`hybridmoe serve`: an OpenAI-compatible server taking llama-server's flag names.

The model file is checked and the port bound first (a bad file or a busy port fails at once, in
one line); then /health says 503 "Loading model" while the model loads in a thread.
llama-server flags that mean nothing here are accepted with a warning, so existing command
lines keep working; its LLAMA_ARG_* environment variables are read too (the command line wins).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import ssl
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridmoe import __version__
from hybridmoe.commands.llama_flags import is_flag
from hybridmoe.commands.model_source import add_model_args, model_file
from hybridmoe.settings import (
    ComputeSettings,
    ContextSettings,
    LoadSettings,
    ParallelSettings,
    PlacementSettings,
    PromptCacheSettings,
    SamplingDefaults,
    ServerLimits,
    SpeculativeSettings,
    add_compute_args,
    add_context_args,
    add_load_args,
    add_parallel_args,
    add_placement_args,
    add_prompt_cache_args,
    add_sampling_args,
    add_server_limit_args,
    add_speculative_args,
    on_off,
    spec_type_notes,
)
from hybridmoe.tokenizer.builtin_templates import BUILTIN_TEMPLATES, resolve_chat_template

log = logging.getLogger("hybridmoe.serve")


_EFFORTS = {"default": None, "none": "none", "minimal": "low", "low": "low", "medium": "medium", "high": "high",
            "xhigh": "high", "max": "high"}


def _effort(value: str) -> str | None:
    """llama-server's --reasoning-effort levels, as the gpt-oss template's three (or none)."""
    if value.lower() not in _EFFORTS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(_EFFORTS)}, got {value!r}")
    return _EFFORTS[value.lower()]


def _json_object(value: str) -> dict[str, Any]:
    try:
        obj = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return obj


def _api_prefix(value: str) -> str:
    """'/api' from 'api', '/api' or '/api/' (llama-server's form: a leading slash, none trailing)."""
    if any(c in value for c in "?#% \t"):
        raise argparse.ArgumentTypeError(f"expected a path such as /api, got {value!r}")
    v = value.strip("/")
    return "/" + v if v else ""


# llama-server's -lm/--load-mode values as (pin the weights in RAM: --mlock, read the file instead
# of mapping it: --no-mmap, which changes nothing here). Its "mlock" reads and locks; pinning the
# mapping gives the same resident, locked weights.
LOAD_MODES = {"auto": (False, False), "mmap": (False, False), "none": (False, True), "dio": (False, True),
              "mlock": (True, False), "mmap+mlock": (True, False)}


@dataclass(frozen=True)
class ServeSettings:
    """Every typed setting `serve` reads from its command line, validated before the port is bound."""

    compute: ComputeSettings
    context: ContextSettings
    parallel: ParallelSettings
    placement: PlacementSettings
    prompt_cache: PromptCacheSettings
    sampling: SamplingDefaults
    limits: ServerLimits
    speculative: SpeculativeSettings
    load: LoadSettings

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeSettings:
        return cls(ComputeSettings.from_args(args), ContextSettings.from_args(args),
                   ParallelSettings.from_args(args), PlacementSettings.from_args(args),
                   PromptCacheSettings.from_args(args), SamplingDefaults.from_args(args),
                   ServerLimits.from_args(args), SpeculativeSettings.from_args(args), LoadSettings.from_args(args))


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (llama-server flags)",
        description=__doc__,
        allow_abbrev=False,  # an unknown llama-server flag must never match one of ours by prefix
    )
    a = p.add_argument
    add_model_args(p, "GGUF file (first part of a split model); default: bundled demo")
    a("--version", action="version", version=f"hybridmoe {__version__}")
    a("--host", default="127.0.0.1", help="address(es) to listen on, comma-separated (UNIX socket: a path "
                                          "ending in .sock); with several, :: binds IPv6 only")
    a("--port", type=int, default=8080)
    a("--api-key", action="append", default=[], help="accepted key (repeatable; comma-separated allowed)")
    a("--api-key-file", default=None, help="file with one API key per line")
    a("-a", "--alias", default=None, help="model name(s), comma-separated: /v1/models id and aliases")
    a("--tags", default=None, help="model tags, comma-separated (informational, listed by /v1/models)")
    a("-fa", "--flash-attn", nargs="?", const="on", default="auto", type=on_off)
    a("--jinja", action="store_true", help="accepted; the GGUF's Jinja template is always used")
    a("--chat-template-file", default=None)
    a("--chat-template", default=None,
      help=f"a built-in template name ({', '.join(sorted(BUILTIN_TEMPLATES))}) or a Jinja template")
    a("--reasoning-format", choices=["none", "auto", "deepseek"], default="auto")
    a("-rea", "--reasoning", default="auto", type=on_off,
      help="reasoning in chats: on, off (harmony replies skip the analysis channel) or auto; the "
           "template's enable_thinking")
    a("--chat-template-kwargs", type=_json_object, default=None)
    a("--sse-ping-interval", type=float, default=30.0, metavar="SECONDS",
      help="a stream silent this long (a long prompt) sends an SSE comment to stay alive; -1 never")
    a("--reasoning-effort", type=_effort, default=None, metavar="LEVEL",
      help="reasoning effort for chat requests that give none: low, medium, high or none (minimal = low; "
           "xhigh, max = high: gpt-oss knows three levels); default: the template's")
    a("--skip-chat-parsing", dest="skip_chat_parsing", action="store_true",
      help="replies as raw text in content (analysis channel and tool calls unparsed): --reasoning-format none")
    a("--no-skip-chat-parsing", dest="skip_chat_parsing", action="store_false")
    a("--ignore-eos", action="store_true", help="requests that give no ignore_eos go on past the end token")
    a("--cache-prompt", dest="cache_prompt", action="store_true", default=True,
      help="reuse cached prompt prefixes (default; per request: cache_prompt)")
    a("--no-cache-prompt", dest="cache_prompt", action="store_false")
    a("--reasoning-budget", type=int, default=-1, metavar="N",
      help="thinking tokens per reply: -1 no limit, 0 end at once, N then the end is written for the model")
    a("--reasoning-budget-message", default="", metavar="MESSAGE",
      help="written before the end of the thinking when the budget is spent")
    a("--mlock", action="store_true", help="pin the mapped weights in RAM")
    a("--no-mmap", action="store_true")
    a("-lm", "--load-mode", choices=list(LOAD_MODES), default="auto",
      help="llama-server's loading mode: mlock and mmap+mlock pin the weights as --mlock; none and dio are "
           "--no-mmap")
    a("--slot-save-path", default=None, help="directory for POST /slots/{id}?action=save|restore files")
    a("--responses-dir", default=None, metavar="DIR",
      help="write stored Responses (previous_response_id) to DIR as well as memory: replicas sharing DIR "
           "continue each other's conversations, and a restart keeps them (docs/scale-out.md)")
    a("--metrics", action="store_true", help="enable the Prometheus /metrics endpoint")
    a("--slots", dest="slots", action="store_true", default=True, help="expose /slots (default)")
    a("--no-slots", dest="slots", action="store_false", help="/slots answers 501")
    a("-v", "--verbose", "--log-verbose", action="store_true",
      help="debug logging; responses carry llama-server's __verbose field")
    a("--swa-full", action="store_true", help="full-size KV cache for sliding-window layers (longer prefix reuse)")
    a("--context-shift", dest="context_shift", action="store_true", default=False,
      help="accepted; see the README (gpt-oss needs --swa-full for it in llama.cpp too)")
    a("--no-context-shift", dest="context_shift", action="store_false")
    a("--api-prefix", type=_api_prefix, default="", metavar="PREFIX",
      help="serve every endpoint and the web page under this path (e.g. /api); nothing outside it")
    a("--ui", "--webui", dest="ui", action="store_true", default=True, help="serve the web chat page (default)")
    a("--no-ui", "--no-webui", dest="ui", action="store_false", help="no web chat page (its paths answer 404)")
    a("--path", dest="static_path", default=None, metavar="DIR",
      help="serve this directory's files at / in place of the chat page (another web UI; public like the page)")
    a("--ui-config", "--webui-config", type=_json_object, default=None, metavar="JSON",
      help="the chat page's defaults for new visitors (llama-server's keys: systemMessage, temperature, top_k, "
           "top_p, min_p, repeat_penalty, max_tokens), as /props ui_settings")
    a("--ui-config-file", "--webui-config-file", default=None, metavar="PATH", help="--ui-config from a file")
    a("--ssl-key-file", default=None, metavar="FNAME", help="PEM private key: serve HTTPS (with --ssl-cert-file)")
    a("--ssl-cert-file", default=None, metavar="FNAME", help="PEM certificate: serve HTTPS (with --ssl-key-file)")
    a("--log-file", default=None, metavar="FNAME", help="write the log to this file as well")
    a("--cors-origins", default="*", help="allowed origins: * (echo any), localhost, or a comma-separated list")
    a("--cors-methods", default="GET, POST, DELETE, OPTIONS")
    a("--cors-headers", default="*", help="allowed headers (* = those the browser asks for)")
    a("--cors-credentials", dest="cors_credentials", action="store_true", default=True)
    a("--no-cors-credentials", dest="cors_credentials", action="store_false")
    for add_group in (add_compute_args, add_context_args, add_parallel_args, add_placement_args,
                      add_prompt_cache_args, add_sampling_args, add_server_limit_args, add_speculative_args,
                      add_load_args):
        add_group(p)
    p.set_defaults(unknown_flags=[], env_used=[], env_notes=[])  # filled by llama_flags.parse_llama_command_line
    return p


def _api_keys(args: argparse.Namespace) -> list[str]:
    """--api-key (LLAMA_API_KEY too: llama_flags reads it first) and --api-key-file, whose lines
    starting with '#' are comments, as in llama-server."""
    keys = [k.strip() for arg in args.api_key for k in arg.split(",") if k.strip()]
    if args.api_key_file:
        lines = (ln.strip() for ln in Path(args.api_key_file).read_text().splitlines())
        keys += [ln for ln in lines if ln and not ln.startswith("#")]
    return keys


def _ui_settings(args: argparse.Namespace) -> dict[str, Any]:
    """--ui-config-file, else --ui-config (llama-server reads the one given last; both is a mistake)."""
    if args.ui_config_file:
        try:
            return _json_object(Path(args.ui_config_file).read_text())
        except OSError as e:
            raise ValueError(f"--ui-config-file {args.ui_config_file}: {e.strerror or e}") from None
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"--ui-config-file {args.ui_config_file}: {e}") from None
    return args.ui_config or {}


def _ssl_files(args: argparse.Namespace) -> dict[str, str]:
    """uvicorn's HTTPS settings from --ssl-key-file / --ssl-cert-file, the pair loaded once here
    so a missing or mismatched file fails in one line before the port is bound."""
    key, cert = args.ssl_key_file, args.ssl_cert_file
    if not key and not cert:
        return {}
    if not (key and cert):
        raise ValueError("--ssl-key-file and --ssl-cert-file go together: HTTPS needs both")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--ssl-cert-file {cert} / --ssl-key-file {key}: {e.strerror or e}") from None
    return {"ssl_keyfile": key, "ssl_certfile": cert}


def _log_to_file(path: str) -> None:
    """--log-file: the same lines as the console, appended to the file."""
    try:
        handler = logging.FileHandler(path)
    except OSError as e:
        raise ValueError(f"--log-file {path}: {e.strerror or e}") from None
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger().addHandler(handler)


class EngineLife:
    """The engine around the HTTP server: from its start, --prompt-cache-dir's Keeper; once, after the
    last request (the graceful shutdown, or the end of run()), the engine stopped and the cache written."""

    def __init__(self, state: Any, cache_dir: str | None) -> None:
        self.state, self.cache_dir = state, cache_dir
        self.keeper: Any = None
        self._stopped = threading.Event()

    def started(self, engine: Any) -> None:
        if self.cache_dir:
            from hybridmoe.engine.prompt_store import Keeper

            self.keeper = Keeper(engine, self.cache_dir).start()

    def stop(self) -> None:
        if self.state.service is None or self._stopped.is_set():
            return
        self._stopped.set()
        if self.keeper is not None:
            self.keeper.close()
        self.state.service.engine.close()
        if self.keeper is None:
            return
        t0 = time.perf_counter()
        try:
            n, nbytes = self.keeper.save()
        except (OSError, RuntimeError) as e:  # the server is stopping either way: say it, go on
            log.error("prompt cache not saved to %s: %s", self.cache_dir, e)
            return
        log.info("prompt cache: %d cached prompts kept in %s (%.0f MiB written in %.1f s)", n, self.cache_dir,
                 nbytes / 2**20, time.perf_counter() - t0)


def _model_path(args: argparse.Namespace) -> tuple[str, bool]:
    """(path, is_random): -hf's cached file (it wins over -m, as in llama-server), the given file,
    the bundled demo, or a synthetic tiny model made once."""
    from hybridmoe.gguf.reader import check_regular_file

    try:
        path = model_file(args)
        if path is not None:
            check_regular_file(path)  # not found / a directory / a FIFO / a device, said as such
    except ValueError as e:
        raise SystemExit(f"hybridmoe serve: error: {e}") from None
    if path is not None:
        return path, False
    from hybridmoe.engine.llm import DEMO_MODEL, resolve_model_path

    return resolve_model_path(None), not DEMO_MODEL.is_file()


def _cache_config(cache: PromptCacheSettings) -> Any:
    """The engine's prompt-reuse settings."""
    from hybridmoe.engine.engine import CacheConfig
    from hybridmoe.gguf.residency import available_ram_bytes

    limit = cache.cache_ram_bytes(available_ram_bytes())
    log.info("prompt cache: %s in RAM, %d checkpoints per slot",
             "no limit" if limit is None else f"{limit / 2**20:.0f} MiB", cache.ctx_checkpoints)
    return CacheConfig(ctx_checkpoints=cache.ctx_checkpoints, checkpoint_every=cache.checkpoint_every,
                       cache_ram_bytes=limit)


def _preflight(args: argparse.Namespace, path: str, load: LoadSettings) -> None:
    """Header, metadata values, port and template kwargs (and with --check-tensors every scale and
    value) checked before the port is bound and before torch is imported: a damaged file fails in
    one line (GGUFError / ValueError)."""
    from hybridmoe.gguf.reader import open_model
    from hybridmoe.gpt_oss_config import GptOssConfig
    from hybridmoe.quant.check import check_tensors_logged
    from hybridmoe.server.limits import check_template_kwargs

    if args.port is not None and not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} is not a TCP port (0-65535)")
    if args.chat_template_kwargs:
        try:
            check_template_kwargs(args.chat_template_kwargs, "--chat-template-kwargs")
        except Exception as e:  # an APIError: say it as a command-line error
            raise ValueError(str(e)) from None
    mf = open_model(path)
    try:
        GptOssConfig.from_metadata(mf.metadata, mf.path)
        if load.check_tensors:
            check_tensors_logged(mf, log)
    finally:
        mf.close()


def _chat_template(args: argparse.Namespace) -> str | None:
    """--chat-template-file wins over --chat-template (a built-in name or Jinja), as llama-server."""
    if args.chat_template_file:
        return Path(args.chat_template_file).read_text()
    if args.chat_template:
        return resolve_chat_template(args.chat_template)
    return None


def _load(args: argparse.Namespace, settings: ServeSettings, path: str, state: Any, server: Any,
          started: Callable[[Any], None]) -> None:
    """Model loading thread: load_model -> Engine -> Service, then /health turns 200. On failure the
    server stops and `serve` exits 1, as llama-server does (no half-alive process)."""
    from hybridmoe.engine.engine import Engine
    from hybridmoe.models.load import ModelSettings, load_model
    from hybridmoe.server.service import Service, ServiceConfig

    s = settings
    try:
        n_parallel = s.parallel.n_parallel
        loaded = load_model(path, ModelSettings(s.compute, s.placement, s.context, n_parallel,
                                                mlock=args.mlock or LOAD_MODES[args.load_mode][0]))
        per_slot = loaded.ctx_size // n_parallel
        if args.swa_full:
            loaded.model.use_full_swa_cache()
        engine = Engine(loaded, n_parallel, per_slot, s.limits.max_queue, batch_size=s.context.step_tokens,
                        cache=_cache_config(s.prompt_cache), speculative=s.speculative)
        if s.prompt_cache.cache_dir:
            n, nbytes = engine.persistence.load_prompt_cache(s.prompt_cache.cache_dir)
            log.info("prompt cache: %d cached prompts (%.0f MiB) read from %s", n, nbytes / 2**20,
                     s.prompt_cache.cache_dir)
        engine.start()
        started(engine)
        config = ServiceConfig(
            model_path=path,
            alias=args.alias or args.hf_repo,  # llama-server names an -hf model by its repository
            tags=[t.strip() for t in (args.tags or "").split(",") if t.strip()],
            reasoning_format="none" if args.skip_chat_parsing else args.reasoning_format,
            reasoning=args.reasoning,
            chat_template=_chat_template(args),
            chat_template_kwargs=args.chat_template_kwargs or {},
            defaults=s.sampling,
            seed=s.sampling.request_seed,
            n_predict=s.sampling.n_predict,
            verbose=args.verbose,
            slot_save_path=args.slot_save_path,
            reasoning_budget=args.reasoning_budget,
            reasoning_effort=args.reasoning_effort,
            ignore_eos=args.ignore_eos,
            cache_prompt=args.cache_prompt,
            reasoning_budget_message=args.reasoning_budget_message,
        )
        state.service = Service(engine, config)
        log.info("model loaded: %s (%d slots x %d tokens of context)", path, n_parallel, per_slot)
    except Exception as e:
        log.debug("load failure", exc_info=True)
        log.error("model failed to load: %s: %s", type(e).__name__, e)
        state.load_error = f"{type(e).__name__}: {e}"
        server.should_exit = True


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format=LOG_FORMAT)
    logging.captureWarnings(True)  # e.g. "no CUDA device: ... run on the CPU" from placement
    if args.log_file:
        _log_to_file(args.log_file)
    settings = ServeSettings.from_args(args)  # SettingsError (a ValueError): one line, before anything starts
    if args.env_used:
        log.info("settings from the environment: %s", ", ".join(args.env_used))
    for note in args.env_notes:
        log.warning("%s", note)
    for word in args.unknown_flags:
        if is_flag(word):
            log.warning("ignoring flag %s: it has no meaning in hybridmoe", word)
    for note in spec_type_notes(args.spec_type, args.spec_default):
        log.warning("%s", note)
    if args.no_mmap or LOAD_MODES[args.load_mode][1]:
        log.warning("%s is accepted, but the experts are always used in place from the mmap (--mlock pins them "
                    "in RAM)", "--no-mmap" if args.no_mmap else f"--load-mode {args.load_mode}")
    for flag, directory in (("--slot-save-path", args.slot_save_path), ("--prompt-cache-dir", args.prompt_cache_dir),
                            ("--responses-dir", args.responses_dir)):
        if directory:
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as e:
                raise SystemExit(f"hybridmoe serve: {flag} {directory}: {e.strerror or e}") from None
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
    _preflight(args, path, settings.load)
    keys = _api_keys(args)
    https = _ssl_files(args)
    ui_settings = _ui_settings(args)
    if args.static_path and not os.path.isdir(args.static_path):
        raise ValueError(f"--path {args.static_path}: not a directory")
    from hybridmoe.server.listen import describe_socket, listen_sockets

    sockets = listen_sockets(args.host, args.port)

    import uvicorn

    from hybridmoe.server.app import ServerState, create_app
    from hybridmoe.server.cors import CorsConfig
    from hybridmoe.server.graceful import GracefulServer

    cors = CorsConfig(origins=args.cors_origins, methods=args.cors_methods, headers=args.cors_headers,
                      credentials=args.cors_credentials)
    state = ServerState(api_keys=keys, metrics_enabled=args.metrics, slots_enabled=args.slots, cors=cors,
                        sse_ping_interval=args.sse_ping_interval, ui=args.ui, api_prefix=args.api_prefix,
                        ui_settings=ui_settings, static_dir=args.static_path, responses_dir=args.responses_dir)
    state.max_body_bytes = settings.limits.max_body_bytes
    app = create_app(state)
    grace = settings.limits.shutdown_grace
    config = uvicorn.Config(app, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=grace + GracefulServer.FINAL_EVENT_SECONDS, **https)
    life = EngineLife(state, settings.prompt_cache.cache_dir)
    server = GracefulServer(config, grace, state, on_stopped=life.stop)
    loader = threading.Thread(target=_load, args=(args, settings, path, state, server, life.started),
                              name="hybridmoe-load", daemon=True)
    loader.start()
    for sock in sockets:
        where = describe_socket(sock, "https" if https else "http") + args.api_prefix
        print(f"hybridmoe: listening on {where} (model {path})", flush=True)
    server.run(sockets=sockets)
    life.stop()
    code = 1 if state.load_error else 0
    if loader.is_alive():
        # Stopped while loading: the loader's native threads cannot be joined, and C++ destructors
        # of running threads abort at exit. Leave without running them.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
