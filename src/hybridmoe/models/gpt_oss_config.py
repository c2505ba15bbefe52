"""gpt-oss hyper-parameters from GGUF metadata: the only code that reads raw metadata keys.

Kept free of torch so planning (`hybridmoe plan`) and inspection start fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridmoe.gguf.reader import GGUFError

ARCH = "gpt-oss"
SWIGLU_ALPHA = 1.702  # hard-coded in every implementation; no GGUF key carries it
SWIGLU_LIMIT = 7.0
DEFAULT_YARN_BETA_FAST = 32.0
DEFAULT_YARN_BETA_SLOW = 1.0


@dataclass(frozen=True)
class GptOssConfig:
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    n_experts_used: int
    expert_ffn: int
    vocab_size: int
    context_length: int
    sliding_window: int
    rms_eps: float
    rope_theta: float
    rope_scaling_factor: float
    rope_original_ctx: int
    yarn_beta_fast: float
    yarn_beta_slow: float

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise GGUFError(f"head_count {self.n_heads} is not a multiple of head_count_kv {self.n_kv_heads}")
        if not 0 < self.n_experts_used <= self.n_experts:
            raise GGUFError(f"expert_used_count {self.n_experts_used} not in 1..expert_count {self.n_experts}")
        if self.head_dim % 2:
            raise GGUFError(f"head dim {self.head_dim} must be even for RoPE")

    @staticmethod
    def layer_is_sliding(layer: int) -> bool:
        # Even layers slide (0, 2, 4, ...); llama.cpp and the reference hard-code this pattern.
        return layer % 2 == 0

    @property
    def kv_bytes_per_token_full(self) -> int:
        """K+V bytes per token over the full-attention layers at 2 bytes per value."""
        n_full = sum(not self.layer_is_sliding(i) for i in range(self.n_layers))
        return n_full * self.n_kv_heads * self.head_dim * 2 * 2

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> "GptOssConfig":
        arch = meta.get("general.architecture")
        if arch != ARCH:
            raise GGUFError(f"unsupported architecture {arch!r}: this loader handles {ARCH!r}")

        def get(key: str, default: Any = None, required: bool = True) -> Any:
            full = f"{ARCH}.{key}"
            if full in meta:
                return meta[full]
            if required and default is None:
                raise GGUFError(f"missing metadata key {full!r}")
            return default

        n_heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        head_dim = int(get("attention.key_length", hidden // n_heads))
        vocab = meta.get("tokenizer.ggml.tokens")
        scaling_type = get("rope.scaling.type", "none")
        factor = float(get("rope.scaling.factor", 1.0)) if scaling_type == "yarn" else 1.0
        return cls(
            n_layers=int(get("block_count")),
            hidden=hidden,
            n_heads=n_heads,
            n_kv_heads=int(get("attention.head_count_kv")),
            head_dim=head_dim,
            n_experts=int(get("expert_count")),
            n_experts_used=int(get("expert_used_count")),
            expert_ffn=int(get("expert_feed_forward_length", get("feed_forward_length", required=False))),
            vocab_size=int(get("vocab_size", len(vocab) if vocab is not None else None)),
            context_length=int(get("context_length")),
            sliding_window=int(get("attention.sliding_window")),
            rms_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling_factor=factor,
            rope_original_ctx=int(get("rope.scaling.original_context_length", 4096)),
            yarn_beta_fast=float(get("rope.scaling.yarn_beta_fast", DEFAULT_YARN_BETA_FAST)),
            yarn_beta_slow=float(get("rope.scaling.yarn_beta_slow", DEFAULT_YARN_BETA_SLOW)),
        )
