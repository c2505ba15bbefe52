"""Context settings: context size, parallel sequences, batch sizes, the server's prompt cache and its
attention switches (`-c`, `-np`, `-b`, `-ub`, `--ctx-checkpoints`, `--cache-ram`, `--swa-full`, ...), as
llama-server names them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from hybridmoe.settings.values import on_off, require

# llama.cpp's -ctk/-ctv types. The cache here holds f32 or f16; the others are kept as f16.
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


@dataclass(frozen=True)
class ContextSettings:
    """ctx_size (-c): total context in tokens, split across the parallel sequences; 0 = the model's.
    batch_size (-b) / ubatch_size (-ub): llama.cpp's logical and physical batch; a forward step
    feeds at most `step_tokens` prompt tokens (the physical batch bounds one computation).
    cache_type_k / cache_type_v (-ctk / -ctv): the GPU KV cache's type; None = the plan's choice
    (f32 when it fits the VRAM budget). One dtype holds K and V: the more precise one asked for."""

    ctx_size: int = 0
    batch_size: int = 2048
    ubatch_size: int = 512
    cache_type_k: str | None = None
    cache_type_v: str | None = None

    def __post_init__(self) -> None:
        require(self.ctx_size >= 0, "-c/--ctx-size", "be >= 0 (0 = the model's)", self.ctx_size)
        require(self.batch_size >= 1, "-b/--batch-size", "be >= 1", self.batch_size)
        require(self.ubatch_size >= 1, "-ub/--ubatch-size", "be >= 1", self.ubatch_size)
        for flag, value in (("-ctk/--cache-type-k", self.cache_type_k), ("-ctv/--cache-type-v", self.cache_type_v)):
            require(value is None or value in CACHE_TYPES, flag, f"be one of {', '.join(CACHE_TYPES)}", value)

    @property
    def step_tokens(self) -> int:
        return min(self.batch_size, self.ubatch_size)

    @property
    def kv_bytes(self) -> float | None:
        """Bytes per cached value that -ctk/-ctv ask for (4 = f32, 2 = f16); None: not given."""
        asked = [t for t in (self.cache_type_k, self.cache_type_v) if t is not None]
        return max((4.0 if t == "f32" else 2.0) for t in asked) if asked else None

    def cache_type_notes(self) -> list[str]:
        """What the cache does differently from what -ctk/-ctv name (said once at load)."""
        return [f"{flag} {t}: kept as f16 (the cache holds f32 or f16)"
                for flag, t in (("-ctk", self.cache_type_k), ("-ctv", self.cache_type_v))
                if t is not None and t not in ("f32", "f16")]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ContextSettings:
        return cls(ctx_size=args.ctx_size, batch_size=args.batch_size, ubatch_size=args.ubatch_size,
                   cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v)


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
        g.add_argument("-ctk", "--cache-type-k", default=d.cache_type_k, metavar="TYPE",
                       help="GPU KV cache type: f32 or f16 (bf16 and quantized types are kept as f16); default: "
                            "f32 when it fits the VRAM budget, else f16"),
        g.add_argument("-ctv", "--cache-type-v", default=d.cache_type_v, metavar="TYPE",
                       help="as -ctk, for V; one dtype holds both, the more precise of the two"),
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
    cache_dir (--prompt-cache-dir): where the cache is kept across restarts (None: not kept).
    """

    ctx_checkpoints: int = 32
    checkpoint_every: int = 2048
    cache_ram_mib: int | None = None
    cache_dir: str | None = None

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
                   cache_ram_mib=args.cache_ram, cache_dir=args.prompt_cache_dir)


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
        g.add_argument("--prompt-cache-dir", default=None, metavar="DIR",
                       help="keep the prompt cache across restarts: written to DIR after 10 s without "
                            "requests and at shutdown (newest first, up to --cache-ram), read back at start "
                            "for the same model, context and KV type"),
        g.add_argument("--cache-idle-slots", action=argparse.BooleanOptionalAction, default=True,
                       help="accepted (always on): a slot's state moves to the RAM cache when another prompt "
                            "takes the slot"),
    ]


@dataclass(frozen=True)
class AttentionSettings:
    """swa_full (--swa-full): sliding-window layers keep a full-size KV cache (longer prefix reuse).
    context_shift (--context-shift) and flash_attn (-fa): llama-server's switches, accepted; a
    sequence that fills its context stops (finish_reason "length"), and attention is always fused."""

    swa_full: bool = False
    context_shift: bool = False
    flash_attn: str = "auto"

    def notes(self) -> list[str]:
        """What is accepted but served differently (said once at start)."""
        if not self.context_shift:
            return []
        # llama.cpp disables it for gpt-oss unless --swa-full (its sliding-window cache cannot shift).
        return ["--context-shift: context shift is not supported by this server, it will be disabled "
                "(generation stops at the end of the context with finish_reason \"length\")"]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> AttentionSettings:
        return cls(swa_full=args.swa_full, context_shift=args.context_shift, flash_attn=args.flash_attn)


def add_attention_args(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    d = AttentionSettings()
    g = parser.add_argument_group("attention")
    return [
        g.add_argument("-fa", "--flash-attn", nargs="?", const="on", default=d.flash_attn, type=on_off),
        g.add_argument("--swa-full", action="store_true",
                       help="full-size KV cache for sliding-window layers (longer prefix reuse)"),
        g.add_argument("--context-shift", dest="context_shift", action="store_true", default=False,
                       help="accepted; see the README (gpt-oss needs --swa-full for it in llama.cpp too)"),
        g.add_argument("--no-context-shift", dest="context_shift", action="store_false"),
    ]
