"""Context settings: context size, parallel sequences, batch sizes, and the server's prompt cache
(`-c`, `-np`, `-b`, `-ub`, `--ctx-checkpoints`, `--cache-ram`, ...), as llama-server names them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from hybridmoe.settings.values import require


@dataclass(frozen=True)
class ContextSettings:
    """ctx_size (-c): total context in tokens, split across the parallel sequences; 0 = the model's.
    batch_size (-b) / ubatch_size (-ub): llama.cpp's logical and physical batch; a forward step
    feeds at most `step_tokens` prompt tokens (the physical batch bounds one computation)."""

    ctx_size: int = 0
    batch_size: int = 2048
    ubatch_size: int = 512

    def __post_init__(self) -> None:
        require(self.ctx_size >= 0, "-c/--ctx-size", "be >= 0 (0 = the model's)", self.ctx_size)
        require(self.batch_size >= 1, "-b/--batch-size", "be >= 1", self.batch_size)
        require(self.ubatch_size >= 1, "-ub/--ubatch-size", "be >= 1", self.ubatch_size)

    @property
    def step_tokens(self) -> int:
        return min(self.batch_size, self.ubatch_size)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ContextSettings:
        return cls(ctx_size=args.ctx_size, batch_size=args.batch_size, ubatch_size=args.ubatch_size)


def add_context_args(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    d = ContextSettings()
    g = parser.add_argument_group("context")
    return [
        g.add_argument("-c", "--ctx-size", type=int, default=d.ctx_size,
                       help="total context in tokens, split across parallel sequences (0 = the model's)"),
        g.add_argument("-b", "--batch-size", type=int, default=d.batch_size,
                       help="logical batch: most prompt tokens per step"),
        g.add_argument("-ub", "--ubatch-size", type=int, default=d.ubatch_size,
                       help="physical batch; a step feeds min(-b, -ub) prompt tokens"),
    ]


@dataclass(frozen=True)
class ParallelSettings:
    """n_parallel (-np): sequences served at once; the context and the plan's KV are split
    across them. The library's `LLM` runs one; the server defaults to llama-server's 4."""

    n_parallel: int = 4

    def __post_init__(self) -> None:
        require(self.n_parallel >= 1, "-np/--parallel", "be >= 1", self.n_parallel)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ParallelSettings:
        # llama-server's -1 is "auto", which serves 4 sequences: the default here.
        return cls() if args.parallel == -1 else cls(n_parallel=args.parallel)


def add_parallel_args(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    g = parser.add_argument_group("parallel sequences")
    return [g.add_argument("-np", "--parallel", type=int, default=ParallelSettings().n_parallel,
                           help="sequences served at once (slots; -1 = auto, the default)")]


@dataclass(frozen=True)
class PromptCacheSettings:
    """How the server keeps prompts for reuse.

    ctx_checkpoints (-ctxcp): sliding-window checkpoints kept per sequence, for prompts that
        diverge before the end of what is cached.
    checkpoint_every (-cms): a checkpoint every N tokens inside a long prompt.
    cache_ram_mib (-cram): MiB of RAM for prompts whose sequence went to another conversation;
        -1 = no limit, 0 = off, None = min(8192, a quarter of the available RAM), small beside the
        page cache that holds the mmap'd experts.
    """

    ctx_checkpoints: int = 32
    checkpoint_every: int = 2048
    cache_ram_mib: int | None = None

    def __post_init__(self) -> None:
        require(self.ctx_checkpoints >= 0, "-ctxcp/--ctx-checkpoints", "be >= 0", self.ctx_checkpoints)
        require(self.checkpoint_every >= 1, "-cms/--checkpoint-min-step", "be >= 1", self.checkpoint_every)
        require(self.cache_ram_mib is None or self.cache_ram_mib >= -1, "-cram/--cache-ram",
                "be >= -1 (-1 = no limit, 0 = off)", self.cache_ram_mib)

    def cache_ram_bytes(self, available_ram: int | None) -> int | None:
        """The RAM cache's limit in bytes (None: no limit), given the RAM available now."""
        if self.cache_ram_mib is None:
            default = 8192 * 2**20
            return min(default, available_ram // 4) if available_ram else default
        return None if self.cache_ram_mib < 0 else self.cache_ram_mib * 2**20

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PromptCacheSettings:
        return cls(ctx_checkpoints=args.ctx_checkpoints, checkpoint_every=args.checkpoint_min_step,
                   cache_ram_mib=args.cache_ram)


def add_prompt_cache_args(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    d = PromptCacheSettings()
    g = parser.add_argument_group("prompt cache")
    return [
        g.add_argument("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints", type=int, default=d.ctx_checkpoints,
                       help="sliding-window checkpoints kept per slot, for prompts that diverge before the end "
                            "of what is cached"),
        g.add_argument("-cms", "--checkpoint-min-step", type=int, default=d.checkpoint_every,
                       help="a checkpoint every N tokens inside a long prompt (one is always taken at the "
                            "prompt's end)"),
        g.add_argument("-cram", "--cache-ram", type=int, default=d.cache_ram_mib,
                       help="MiB of RAM for prompts whose slot went to another conversation (-1 = no limit, "
                            "0 = off; default: 8192 or a quarter of the available RAM, whichever is less)"),
        g.add_argument("--cache-idle-slots", action=argparse.BooleanOptionalAction, default=True,
                       help="accepted (always on): a slot's state moves to the RAM cache when another prompt "
                            "takes the slot"),
    ]
