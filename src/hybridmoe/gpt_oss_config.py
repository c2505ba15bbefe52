"""gpt-oss hyper-parameters from GGUF metadata: the only code that reads raw metadata keys.

Kept free of torch so planning (`hybridmoe plan`) and inspection start fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridmoe.gguf.errors import GGUFError
from hybridmoe.gguf.validate import MetadataValues

ARCH = "gpt-oss"
SWIGLU_ALPHA = 1.702  # hard-coded in every implementation; no GGUF key carries it
SWIGLU_LIMIT = 7.0
DEFAULT_YARN_BETA_FAST = 32.0
DEFAULT_YARN_BETA_SLOW = 1.0
DEFAULT_ROPE_ORIGINAL_CTX = 4096
# Far above any real model (gpt-oss-120b: 36 layers, width 2880, 128 experts, 201k vocab); a
# larger value is a damaged file, refused before it sizes an allocation.
MAX_LAYERS = 4096
MAX_WIDTH = 1 << 24


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
        if min(self.n_layers, self.n_heads, self.n_kv_heads, self.sliding_window) < 1:
            raise GGUFError(f"layer, head counts and sliding window must be positive: {self}")
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

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], source: str = "model metadata") -> "GptOssConfig":
        """The config from GGUF metadata; GGUFError naming `source` (the file), the key and the
        value for anything missing, mistyped or out of range, before any of it is used."""
        arch = meta.get("general.architecture")
        if arch != ARCH:
            raise GGUFError(f"{source}: unsupported architecture {arch!r}: this loader handles {ARCH!r}")
        m = MetadataValues(meta, source, prefix=f"{ARCH}.")
        n_layers = m.int("block_count", maximum=MAX_LAYERS)
        hidden = m.int("embedding_length", maximum=MAX_WIDTH)
        n_heads = m.int("attention.head_count", maximum=MAX_WIDTH)
        n_kv_heads = m.int("attention.head_count_kv", maximum=MAX_WIDTH)
        if n_heads % n_kv_heads:
            raise m.fail("attention.head_count_kv", n_kv_heads,
                         f"does not divide attention.head_count = {n_heads}")
        head_dim = m.int("attention.key_length", max(1, hidden // n_heads), maximum=MAX_WIDTH)
        if head_dim % 2:
            raise m.fail("attention.key_length", head_dim, "must be even for RoPE")
        n_experts = m.int("expert_count", maximum=MAX_WIDTH)
        n_used = m.int("expert_used_count", maximum=n_experts)
        ffn_key = "expert_feed_forward_length" if m.has("expert_feed_forward_length") else "feed_forward_length"
        vocab = meta.get("tokenizer.ggml.tokens")
        n_vocab = len(vocab) if isinstance(vocab, list) and vocab else None
        scaling_type = m.raw("rope.scaling.type", "none")
        yarn = scaling_type == "yarn"
        factor = m.float("rope.scaling.factor", 1.0) if yarn else 1.0
        beta_fast = m.float("rope.scaling.yarn_beta_fast", DEFAULT_YARN_BETA_FAST)
        beta_slow = m.float("rope.scaling.yarn_beta_slow", DEFAULT_YARN_BETA_SLOW)
        if factor > 1.0 and not beta_fast > beta_slow:
            raise m.fail("rope.scaling.yarn_beta_fast", beta_fast,
                         f"must be greater than rope.scaling.yarn_beta_slow = {beta_slow:g}")
        return cls(
            n_layers=n_layers,
            hidden=hidden,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            n_experts=n_experts,
            n_experts_used=n_used,
            expert_ffn=m.int(ffn_key, maximum=MAX_WIDTH),
            vocab_size=m.int("vocab_size", n_vocab, maximum=MAX_WIDTH),
            context_length=m.int("context_length"),
            sliding_window=m.int("attention.sliding_window"),  # even layers slide: always used
            rms_eps=m.float("attention.layer_norm_rms_epsilon"),
            rope_theta=m.float("rope.freq_base", 10000.0, above=1.0),  # log(base) divides
            rope_scaling_factor=factor,
            rope_original_ctx=m.int("rope.scaling.original_context_length", DEFAULT_ROPE_ORIGINAL_CTX),
            yarn_beta_fast=beta_fast,
            yarn_beta_slow=beta_slow,
        )

    def to_metadata(self) -> dict[str, Any]:
        """The `gpt-oss.*` keys `from_metadata` reads back to this config (synthetic files, tests).

        Keys at their defaults (YaRN betas) are left out as in released files; the vocabulary
        size comes from the tokenizer's token list, so it is not written either."""
        p = f"{ARCH}."
        meta: dict[str, Any] = {
            p + "block_count": self.n_layers,
            p + "context_length": self.context_length,
            p + "embedding_length": self.hidden,
            p + "feed_forward_length": self.expert_ffn,
            p + "expert_feed_forward_length": self.expert_ffn,
            p + "attention.head_count": self.n_heads,
            p + "attention.head_count_kv": self.n_kv_heads,
            p + "attention.key_length": self.head_dim,
            p + "attention.value_length": self.head_dim,
            p + "attention.layer_norm_rms_epsilon": self.rms_eps,
            p + "attention.sliding_window": self.sliding_window,
            p + "expert_count": self.n_experts,
            p + "expert_used_count": self.n_experts_used,
            p + "rope.freq_base": self.rope_theta,
        }
        if self.rope_scaling_factor != 1.0:
            meta[p + "rope.scaling.type"] = "yarn"
            meta[p + "rope.scaling.factor"] = self.rope_scaling_factor
        if self.rope_scaling_factor != 1.0 or self.rope_original_ctx != DEFAULT_ROPE_ORIGINAL_CTX:
            meta[p + "rope.scaling.original_context_length"] = self.rope_original_ctx
        if self.yarn_beta_fast != DEFAULT_YARN_BETA_FAST:
            meta[p + "rope.scaling.yarn_beta_fast"] = self.yarn_beta_fast
        if self.yarn_beta_slow != DEFAULT_YARN_BETA_SLOW:
            meta[p + "rope.scaling.yarn_beta_slow"] = self.yarn_beta_slow
        return meta
