"""Server limits: how much the server queues, accepts and waits (`--max-queue`, `--max-body-size`,
`--shutdown-grace`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

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
