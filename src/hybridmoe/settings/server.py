"""Server settings: where it listens and who may call it (`--host`, `--port`, `--api-key`, ...), what
its endpoints name and keep (`--alias`, `--metrics`, `--slot-save-path`, ...), what a request that
says nothing gets (`--ignore-eos`, `--no-cache-prompt`), and how much it queues, accepts and waits
(`--max-queue`, `--max-body-size`, `--shutdown-grace`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from hybridmoe.settings.values import byte_size, require


@dataclass(frozen=True)
class ServerLimits:
    """max_queue: requests that may wait for a free sequence before a 503.
    max_body_bytes: the largest request body (a 131k-token prompt is well under 1 MB of JSON);
        larger ones get 413.
    shutdown_grace: seconds in-flight requests may run on after SIGTERM before they are ended."""

    max_queue: int = 64
    max_body_bytes: int = 8 << 20
    shutdown_grace: float = 5.0

    def __post_init__(self) -> None:
        require(self.max_queue >= 0, "--max-queue", "be >= 0", self.max_queue)
        require(self.max_body_bytes >= 1, "--max-body-size", "be >= 1 byte", self.max_body_bytes)
        require(self.shutdown_grace >= 0, "--shutdown-grace", "be >= 0 seconds", self.shutdown_grace)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerLimits:
        return cls(max_queue=args.max_queue, max_body_bytes=args.max_body_size,
                   shutdown_grace=args.shutdown_grace)


def add_server_limit_args(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    d = ServerLimits()
    g = parser.add_argument_group("server limits")
    return [
        g.add_argument("--max-queue", type=int, default=d.max_queue,
                       help="requests that may wait for a slot before 503"),
        g.add_argument("--max-body-size", type=byte_size, default=d.max_body_bytes,
                       help=f"largest request body in bytes, k/M/G suffix allowed (default {d.max_body_bytes >> 20}M); "
                            "larger ones get 413"),
        g.add_argument("--shutdown-grace", type=float, default=d.shutdown_grace,
                       help=f"seconds in-flight requests may run on after SIGTERM before they are ended "
                            f"(default {d.shutdown_grace:g})"),
    ]


def api_prefix(value: str) -> str:
    """'/api' from 'api', '/api' or '/api/' (llama-server's form: a leading slash, none trailing)."""
    if any(c in value for c in "?#% \t"):
        raise argparse.ArgumentTypeError(f"expected a path such as /api, got {value!r}")
    v = value.strip("/")
    return "/" + v if v else ""


@dataclass(frozen=True)
class ServerSettings:
    """Where the HTTP server listens, who may call it, and what it logs.

    host (--host): address(es), comma-separated; a path ending in .sock is a UNIX socket.
    port (--port): the TCP port (0: any free one).
    api_key (--api-key; LLAMA_API_KEY): accepted keys as given, each possibly a comma-separated
        list; api_key_file (--api-key-file): more, one per line. api_keys() reads both.
    api_prefix (--api-prefix): every route under this path ("/api"), nothing outside it.
    ssl_key_file / ssl_cert_file (--ssl-key-file / --ssl-cert-file): the PEM pair that makes it HTTPS.
    sse_ping_interval (--sse-ping-interval): seconds a stream may stay silent before an SSE
        comment keeps it alive (<= 0: never).
    verbose (-v): debug logging, and llama-server's __verbose field in replies.
    log_file (--log-file): the log appended to this file as well.
    """

    host: str = "127.0.0.1"
    port: int = 8080
    api_key: tuple[str, ...] = ()
    api_key_file: str | None = None
    api_prefix: str = ""
    ssl_key_file: str | None = None
    ssl_cert_file: str | None = None
    sse_ping_interval: float = 30.0
    verbose: bool = False
    log_file: str | None = None

    def __post_init__(self) -> None:
        require(0 <= self.port <= 65535, "--port", "be a TCP port (0-65535)", self.port)
        require(not isinstance(self.api_key, str), "--api-key", "be a list of keys, not a str", self.api_key)

    def api_keys(self) -> list[str]:
        """--api-key's keys, then --api-key-file's lines (those starting with '#' are comments, as in
        llama-server). OSError if the file cannot be read."""
        keys = [k.strip() for arg in self.api_key for k in arg.split(",") if k.strip()]
        if self.api_key_file:
            lines = (ln.strip() for ln in Path(self.api_key_file).read_text().splitlines())
            keys += [ln for ln in lines if ln and not ln.startswith("#")]
        return keys

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerSettings:
        return cls(host=args.host, port=args.port, api_key=tuple(args.api_key), api_key_file=args.api_key_file,
                   api_prefix=args.api_prefix, ssl_key_file=args.ssl_key_file, ssl_cert_file=args.ssl_cert_file,
                   sse_ping_interval=args.sse_ping_interval, verbose=args.verbose, log_file=args.log_file)


def add_server_args(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    d = ServerSettings()
    g = parser.add_argument_group("server")
    return [
        g.add_argument("--host", default=d.host, help="address(es) to listen on, comma-separated (UNIX socket: a "
                                                     "path ending in .sock); with several, :: binds IPv6 only"),
        g.add_argument("--port", type=int, default=d.port),
        g.add_argument("--api-key", action="append", default=[],
                       help="accepted key (repeatable; comma-separated allowed)"),
        g.add_argument("--api-key-file", default=None, help="file with one API key per line"),
        g.add_argument("--api-prefix", type=api_prefix, default=d.api_prefix, metavar="PREFIX",
                       help="serve every endpoint and the web page under this path (e.g. /api); nothing outside it"),
        g.add_argument("--ssl-key-file", default=None, metavar="FNAME",
                       help="PEM private key: serve HTTPS (with --ssl-cert-file)"),
        g.add_argument("--ssl-cert-file", default=None, metavar="FNAME",
                       help="PEM certificate: serve HTTPS (with --ssl-key-file)"),
        g.add_argument("--sse-ping-interval", type=float, default=d.sse_ping_interval, metavar="SECONDS",
                       help="a stream silent this long (a long prompt) sends an SSE comment to stay alive; -1 never"),
        g.add_argument("-v", "--verbose", "--log-verbose", action="store_true",
                       help="debug logging; responses carry llama-server's __verbose field"),
        g.add_argument("--log-file", default=None, metavar="FNAME", help="write the log to this file as well"),
    ]


@dataclass(frozen=True)
class EndpointSettings:
    """What the endpoints name, answer and keep.

    alias (-a/--alias): model name(s), comma-separated: /v1/models' id and aliases (None: the file's).
    tags (--tags): model tags /v1/models lists (informational).
    metrics (--metrics): the Prometheus /metrics endpoint.
    slots (--slots / --no-slots): /slots answers (else 501).
    slot_save_path (--slot-save-path): the directory of /slots save and restore files.
    responses_dir (--responses-dir): stored Responses written here as well as kept in memory, so
        replicas sharing it continue each other's conversations and a restart keeps them.
    """

    alias: str | None = None
    tags: tuple[str, ...] = ()
    metrics: bool = False
    slots: bool = True
    slot_save_path: str | None = None
    responses_dir: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EndpointSettings:
        tags = tuple(t.strip() for t in (args.tags or "").split(",") if t.strip())
        return cls(alias=args.alias, tags=tags, metrics=args.metrics, slots=args.slots,
                   slot_save_path=args.slot_save_path, responses_dir=args.responses_dir)


def add_endpoint_args(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    g = parser.add_argument_group("endpoints")
    return [
        g.add_argument("-a", "--alias", default=None, help="model name(s), comma-separated: /v1/models id and aliases"),
        g.add_argument("--tags", default=None,
                       help="model tags, comma-separated (informational, listed by /v1/models)"),
        g.add_argument("--metrics", action="store_true", help="enable the Prometheus /metrics endpoint"),
        g.add_argument("--slots", dest="slots", action="store_true", default=True, help="expose /slots (default)"),
        g.add_argument("--no-slots", dest="slots", action="store_false", help="/slots answers 501"),
        g.add_argument("--slot-save-path", default=None,
                       help="directory for POST /slots/{id}?action=save|restore files"),
        g.add_argument("--responses-dir", default=None, metavar="DIR",
                       help="write stored Responses (previous_response_id) to DIR as well as memory: replicas sharing "
                            "DIR continue each other's conversations, and a restart keeps them (docs/scale-out.md)"),
    ]


@dataclass(frozen=True)
class RequestDefaults:
    """What a request that leaves them out gets: ignore_eos (--ignore-eos: go on past the end token)
    and cache_prompt (--no-cache-prompt: compute the whole prompt)."""

    ignore_eos: bool = False
    cache_prompt: bool = True

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RequestDefaults:
        return cls(ignore_eos=args.ignore_eos, cache_prompt=args.cache_prompt)


def add_request_default_args(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    g = parser.add_argument_group("request defaults")
    return [
        g.add_argument("--ignore-eos", action="store_true",
                       help="requests that give no ignore_eos go on past the end token"),
        g.add_argument("--cache-prompt", dest="cache_prompt", action="store_true", default=True,
                       help="reuse cached prompt prefixes (default; per request: cache_prompt)"),
        g.add_argument("--no-cache-prompt", dest="cache_prompt", action="store_false"),
    ]
