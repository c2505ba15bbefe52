"""`hybridmoe serve`: an OpenAI-compatible server taking llama-server's flag names.

The model file is checked and the port bound first (a bad file or a busy port fails at once, in
one line); then /health says 503 "Loading model" while the model loads in a thread.
llama-server flags that mean nothing here are accepted with a warning, so existing command
lines keep working; its LLAMA_ARG_* environment variables are read too (the command line wins).
"""

from __future__ import annotations

import argparse
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
    AttentionSettings,
    ChatSettings,
    ComputeSettings,
    ContextSettings,
    EndpointSettings,
    LoadSettings,
    ParallelSettings,
    PlacementSettings,
    PromptCacheSettings,
    RequestDefaults,
    ResidencySettings,
    SamplingDefaults,
    ServerLimits,
    ServerSettings,
    SpeculativeSettings,
    WebSettings,
    add_attention_args,
    add_chat_args,
    add_compute_args,
    add_context_args,
    add_endpoint_args,
    add_load_args,
    add_parallel_args,
    add_placement_args,
    add_prompt_cache_args,
    add_request_default_args,
    add_residency_args,
    add_sampling_args,
    add_server_args,
    add_server_limit_args,
    add_speculative_args,
    add_web_args,
    spec_type_notes,
)
from hybridmoe.tokenizer.builtin_templates import BUILTIN_TEMPLATES, resolve_chat_template

log = logging.getLogger("hybridmoe.serve")


@dataclass(frozen=True)
class ServeSettings:
    """Every typed setting `serve` reads from its command line, validated before the port is bound."""

    server: ServerSettings
    endpoints: EndpointSettings
    request_defaults: RequestDefaults
    web: WebSettings
    chat: ChatSettings
    limits: ServerLimits
    compute: ComputeSettings
    context: ContextSettings
    attention: AttentionSettings
    parallel: ParallelSettings
    placement: PlacementSettings
    prompt_cache: PromptCacheSettings
    sampling: SamplingDefaults
    speculative: SpeculativeSettings
    load: LoadSettings
    residency: ResidencySettings

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeSettings:
        return cls(ServerSettings.from_args(args), EndpointSettings.from_args(args), RequestDefaults.from_args(args),
                   WebSettings.from_args(args), ChatSettings.from_args(args), ServerLimits.from_args(args),
                   ComputeSettings.from_args(args), ContextSettings.from_args(args),
                   AttentionSettings.from_args(args), ParallelSettings.from_args(args),
                   PlacementSettings.from_args(args), PromptCacheSettings.from_args(args),
                   SamplingDefaults.from_args(args), SpeculativeSettings.from_args(args),
                   LoadSettings.from_args(args), ResidencySettings.from_args(args))


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (llama-server flags)",
        description=__doc__,
        allow_abbrev=False,  # an unknown llama-server flag must never match one of ours by prefix
    )
    add_model_args(p, "GGUF file (first part of a split model); default: bundled demo")
    p.add_argument("--version", action="version", version=f"hybridmoe {__version__}")
    add_server_args(p)
    add_endpoint_args(p)
    add_request_default_args(p)
    add_web_args(p)
    add_chat_args(p, list(BUILTIN_TEMPLATES))
    for add_group in (add_server_limit_args, add_compute_args, add_context_args, add_attention_args,
                      add_parallel_args, add_placement_args, add_prompt_cache_args, add_sampling_args,
                      add_speculative_args, add_load_args, add_residency_args):
        add_group(p)
    p.set_defaults(unknown_flags=[], env_used=[], env_notes=[])  # filled by llama_flags.parse_llama_command_line
    return p


def _ssl_files(server: ServerSettings) -> dict[str, str]:
    """uvicorn's HTTPS settings from --ssl-key-file / --ssl-cert-file, the pair loaded once here
    so a missing or mismatched file fails in one line before the port is bound."""
    key, cert = server.ssl_key_file, server.ssl_cert_file
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


def _preflight(chat: ChatSettings, path: str, load: LoadSettings) -> None:
    """Template kwargs, header and metadata values (and with --check-tensors every scale and value)
    checked before the port is bound and before torch is imported: a damaged file fails in one
    line (GGUFError / ValueError)."""
    from hybridmoe.gguf.reader import open_model
    from hybridmoe.gpt_oss_config import GptOssConfig
    from hybridmoe.quant.check import check_tensors_logged
    from hybridmoe.server.limits import check_template_kwargs

    if chat.chat_template_kwargs:
        try:
            check_template_kwargs(chat.chat_template_kwargs, "--chat-template-kwargs")
        except Exception as e:  # an APIError: say it as a command-line error
            raise ValueError(str(e)) from None
    mf = open_model(path)
    try:
        GptOssConfig.from_metadata(mf.metadata, mf.path)
        if load.check_tensors:
            check_tensors_logged(mf, log)
    finally:
        mf.close()


def _chat_template(chat: ChatSettings) -> str | None:
    """--chat-template-file wins over --chat-template (a built-in name or Jinja), as llama-server."""
    if chat.chat_template_file:
        return Path(chat.chat_template_file).read_text()
    if chat.chat_template:
        return resolve_chat_template(chat.chat_template)
    return None


def _service_config(s: ServeSettings, path: str, model_name: str | None) -> Any:
    """What the Service reads: the chat and endpoint settings, request and sampling defaults."""
    from hybridmoe.server.service import ServiceConfig

    return ServiceConfig(
        model_path=path, alias=model_name, tags=list(s.endpoints.tags), reasoning_format=s.chat.parsed_format,
        reasoning=s.chat.reasoning, chat_template=_chat_template(s.chat),
        chat_template_kwargs=s.chat.chat_template_kwargs or {}, defaults=s.sampling, seed=s.sampling.request_seed,
        n_predict=s.sampling.n_predict, verbose=s.server.verbose, slot_save_path=s.endpoints.slot_save_path,
        reasoning_budget=s.chat.reasoning_budget, reasoning_effort=s.chat.reasoning_effort,
        ignore_eos=s.request_defaults.ignore_eos, cache_prompt=s.request_defaults.cache_prompt,
        reasoning_budget_message=s.chat.reasoning_budget_message)


def _load(s: ServeSettings, path: str, model_name: str | None, state: Any, server: Any,
          started: Callable[[Any], None]) -> None:
    """Model loading thread: load_model -> Engine -> Service, then /health turns 200. On failure the
    server stops and `serve` exits 1, as llama-server does (no half-alive process)."""
    from hybridmoe.engine.engine import Engine
    from hybridmoe.models.load import ModelSettings, load_model
    from hybridmoe.server.service import Service

    try:
        n_parallel = s.parallel.n_parallel
        loaded = load_model(path, ModelSettings(s.compute, s.placement, s.context, n_parallel, mlock=s.residency.pin))
        per_slot = loaded.ctx_size // n_parallel
        if s.attention.swa_full:
            loaded.model.use_full_swa_cache()
        engine = Engine(loaded, n_parallel, per_slot, s.limits.max_queue, batch_size=s.context.step_tokens,
                        cache=_cache_config(s.prompt_cache), speculative=s.speculative)
        if s.prompt_cache.cache_dir:
            n, nbytes = engine.persistence.load_prompt_cache(s.prompt_cache.cache_dir)
            log.info("prompt cache: %d cached prompts (%.0f MiB) read from %s", n, nbytes / 2**20,
                     s.prompt_cache.cache_dir)
        engine.start()
        started(engine)
        state.service = Service(engine, _service_config(s, path, model_name))
        log.info("model loaded: %s (%d slots x %d tokens of context)", path, n_parallel, per_slot)
    except Exception as e:
        log.debug("load failure", exc_info=True)
        log.error("model failed to load: %s: %s", type(e).__name__, e)
        state.load_error = f"{type(e).__name__}: {e}"
        server.should_exit = True


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _log_setting_notes(args: argparse.Namespace, s: ServeSettings) -> None:
    """The environment variables read, and what was set aside or is served differently: logged once."""
    if args.env_used:
        log.info("settings from the environment: %s", ", ".join(args.env_used))
    for note in args.env_notes:
        log.warning("%s", note)
    for word in args.unknown_flags:
        if is_flag(word):
            log.warning("ignoring flag %s: it has no meaning in hybridmoe", word)
    for note in (*spec_type_notes(args.spec_type, args.spec_default), *s.residency.notes(), *s.attention.notes()):
        log.warning("%s", note)


def _check_paths(s: ServeSettings) -> None:
    """Directories made and names checked before the model loads: each failure says its flag."""
    for flag, directory in (("--slot-save-path", s.endpoints.slot_save_path),
                            ("--prompt-cache-dir", s.prompt_cache.cache_dir),
                            ("--responses-dir", s.endpoints.responses_dir)):
        if directory:
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as e:
                raise SystemExit(f"hybridmoe serve: {flag} {directory}: {e.strerror or e}") from None
    if s.chat.chat_template and not s.chat.chat_template_file:
        try:
            resolve_chat_template(s.chat.chat_template)
        except ValueError as e:
            raise SystemExit(f"hybridmoe serve: --chat-template: {e}") from None


def run(args: argparse.Namespace) -> int:
    s = ServeSettings.from_args(args)  # SettingsError (a ValueError): one line, before anything starts
    logging.basicConfig(level=logging.DEBUG if s.server.verbose else logging.INFO, format=LOG_FORMAT)
    logging.captureWarnings(True)  # e.g. "no CUDA device: ... run on the CPU" from placement
    if s.server.log_file:
        _log_to_file(s.server.log_file)
    _log_setting_notes(args, s)
    _check_paths(s)
    path, is_random = _model_path(args)
    if is_random:
        log.warning("no bundled demo model in this build: serving a RANDOM synthetic model (%s); its output is "
                    "noise. Pass -m FILE for a real model.", path)
    _preflight(s.chat, path, s.load)
    keys = s.server.api_keys()
    https = _ssl_files(s.server)
    ui_settings = s.web.ui_settings()
    if s.web.static_path and not os.path.isdir(s.web.static_path):
        raise ValueError(f"--path {s.web.static_path}: not a directory")
    from hybridmoe.server.listen import describe_socket, listen_sockets

    sockets = listen_sockets(s.server.host, s.server.port)

    import uvicorn

    from hybridmoe.server.app import ServerState, create_app
    from hybridmoe.server.cors import CorsConfig
    from hybridmoe.server.graceful import GracefulServer

    w = s.web
    cors = CorsConfig(origins=w.cors_origins, methods=w.cors_methods, headers=w.cors_headers,
                      credentials=w.cors_credentials)
    state = ServerState(api_keys=keys, metrics_enabled=s.endpoints.metrics, slots_enabled=s.endpoints.slots, cors=cors,
                        sse_ping_interval=s.server.sse_ping_interval, ui=w.ui, api_prefix=s.server.api_prefix,
                        ui_settings=ui_settings, static_dir=w.static_path, responses_dir=s.endpoints.responses_dir)
    state.max_body_bytes = s.limits.max_body_bytes
    app = create_app(state)
    grace = s.limits.shutdown_grace
    config = uvicorn.Config(app, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=grace + GracefulServer.FINAL_EVENT_SECONDS, **https)
    life = EngineLife(state, s.prompt_cache.cache_dir)
    server = GracefulServer(config, grace, state, on_stopped=life.stop)
    model_name = s.endpoints.alias or args.hf_repo  # llama-server names an -hf model by its repository
    loader = threading.Thread(target=_load, args=(s, path, model_name, state, server, life.started),
                              name="hybridmoe-load", daemon=True)
    loader.start()
    for sock in sockets:
        where = describe_socket(sock, "https" if https else "http") + s.server.api_prefix
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
