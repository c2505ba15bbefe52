"""CPU compute settings: kernel threads and fast math (`-t`, `--fast-math`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from hybridmoe.settings.values import require


@dataclass(frozen=True)
class ComputeSettings:
    """threads: kernel and torch threads (None: one per physical core).
    fast_math: int8 activations on the GEMV path, ~5e-3 relative error per matmul; off keeps fp32
    activations, which match the reference to ~1e-6."""

    threads: int | None = None
    fast_math: bool = False

    def __post_init__(self) -> None:
        require(self.threads is None or self.threads >= 1, "-t/--threads", "be >= 1", self.threads)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ComputeSettings:
        return cls(threads=args.threads, fast_math=args.fast_math)


def add_compute_args(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    g = parser.add_argument_group("compute")
    return [
        g.add_argument("-t", "--threads", type=int, default=None,
                       help="CPU threads for the expert kernels and torch (default: one per physical core)"),
        g.add_argument("--fast-math", action="store_true",
                       help="int8 activations (decode, and MXFP4 experts in prompts): faster, ~5e-3 relative "
                            "error per matmul (default: exact fp32)"),
    ]
