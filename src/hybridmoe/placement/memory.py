"""Byte formulas for the non-weight memory of a plan (KV cache, compute buffers) and the probe
for free VRAM (available RAM: gguf.residency.available_ram_bytes).

KV per layer and token = n_kv_heads * head_dim * 2 (K and V) * bytes per value
(docs/gpt-oss.md: 2048 B at f16 for gpt-oss). Full-attention layers keep the
whole context; sliding-window layers keep `window + ubatch` positions (the window the newest
query needs plus one micro-batch being appended), never more than the context.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hybridmoe.gpt_oss_config import GptOssConfig

GIB = 1 << 30
MIB = 1 << 20
F32 = 4
# Keys are walked in blocks of this many positions by a flash-style attention kernel, so the
# score tile is bounded by it instead of by the context (a full score matrix at 131072 tokens
# would be 17 GB for a 512-token micro-batch).
ATTN_KEY_BLOCK = 1024
# Safety margin kept free when the VRAM budget comes from the device's free memory
# (llama.cpp's --fit keeps 1024 MiB free by default).
VRAM_MARGIN_BYTES = 1024 * MIB


def gib(n: int) -> str:
    """Bytes as the plan's notes and errors say them: '1.50 GiB'."""
    return f"{n / GIB:.2f} GiB"


def kv_bytes_per_token(cfg: GptOssConfig, kv_dtype_bytes: float) -> float:
    """K+V bytes one layer stores per cached position."""
    return cfg.n_kv_heads * cfg.head_dim * 2 * kv_dtype_bytes


def kv_positions(cfg: GptOssConfig, layer: int, ctx_size: int, ubatch: int) -> int:
    """Cached positions per sequence for `layer` (see module docstring)."""
    if cfg.layer_is_sliding(layer):
        return min(ctx_size, cfg.sliding_window + ubatch)
    return ctx_size


def layer_kv_bytes(cfg: GptOssConfig, layer: int, ctx_size: int, ubatch: int, n_parallel: int,
                   kv_dtype_bytes: float) -> int:
    """KV bytes of one layer over all `n_parallel` slots, each with a `ctx_size` context."""
    per_seq = kv_positions(cfg, layer, ctx_size, ubatch) * kv_bytes_per_token(cfg, kv_dtype_bytes)
    return int(round(per_seq * n_parallel))


@dataclass(frozen=True)
class ComputeEstimate:
    """Working memory of one device for one forward step of `ubatch` tokens, in bytes.

    activations: fp32 hidden state, residual, normed input, q/k/v, attention output, router
        logits for the micro-batch, i.e. ubatch * (3H + 2Q + 2KV + E) * 4 B (one layer at a time:
        buffers are reused layer to layer).
    attention: score tile of a blocked kernel, n_heads * ubatch * min(ctx, ATTN_KEY_BLOCK) * 4 B.
    experts: routed-expert intermediates when this device computes experts,
        ubatch * k * (2F + F + H) * 4 B (gate and up outputs, activation, down outputs).
    logits: one fp32 row of vocab_size per sequence per step (n_parallel rows) on the device of
        the output head.
    expert_upload: GPU staging for prompt batches whose experts live on the CPU: `upload_buffers`
        buffers, each the largest CPU-resident layer's expert bytes (a 512-token batch routes to
        almost every expert: 1 - (1 - k/E)^512 ~ 100 %).
    """

    activations: int = 0
    attention: int = 0
    experts: int = 0
    logits: int = 0
    expert_upload: int = 0

    @property
    def total(self) -> int:
        return sum(self.as_dict().values())

    def as_dict(self) -> dict[str, int]:
        """Each part by name, in the order above (the plan's JSON and its printed table)."""
        return dataclasses.asdict(self)


def estimate_compute(cfg: GptOssConfig, *, ubatch: int, ctx_size: int, n_parallel: int,
                     runs_layers: bool, runs_experts: bool, runs_output: bool,
                     upload_bytes: int) -> ComputeEstimate:
    """Compute-buffer estimate for one device (see ComputeEstimate for each term)."""
    H, Q = cfg.hidden, cfg.n_heads * cfg.head_dim
    KV, E, k, F = cfg.n_kv_heads * cfg.head_dim, cfg.n_experts, cfg.n_experts_used, cfg.expert_ffn
    act = ubatch * (3 * H + 2 * Q + 2 * KV + E) * F32 if runs_layers else 0
    attn = cfg.n_heads * ubatch * min(ctx_size, ATTN_KEY_BLOCK) * F32 if runs_layers else 0
    exp = ubatch * k * (3 * F + H) * F32 if runs_experts else 0
    logits = n_parallel * cfg.vocab_size * F32 if runs_output else 0
    return ComputeEstimate(act, attn, exp, logits, upload_bytes)


def cuda_free_bytes(device: str) -> int | None:
    """Free memory of a CUDA device, or None when torch/CUDA is absent.

    torch is imported here only: `hybridmoe plan` must stay torch-free unless it needs this.
    """
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


def kv_cache_bytes(cfg: GptOssConfig, ctx_total: int, n_parallel: int, kv_dtype_bytes: float,
                   ring_slack: int = 64) -> int:
    """KV bytes of `n_parallel` slots sharing `ctx_total` positions, as the CPU cache allocates
    them: full layers per slot context, sliding layers a ring of window + slack."""
    per_slot = max(1, ctx_total // max(1, n_parallel))
    per_token = kv_bytes_per_token(cfg, kv_dtype_bytes)
    positions = sum(min(per_slot, cfg.sliding_window + ring_slack) if cfg.layer_is_sliding(i) else per_slot
                    for i in range(cfg.n_layers))
    return int(positions * per_token * n_parallel)


@dataclass(frozen=True)
class ContextFit:
    ctx_size: int  # total context to use
    note: str | None  # why it was capped (log it), None when the request fits


def fit_context(cfg: GptOssConfig, requested: int, n_parallel: int, kv_dtype_bytes: float,
                available: int | None) -> ContextFit:
    """The total context to allocate KV for. `requested` 0 means the model's context length,
    capped (with a note) so the KV cache takes at most half the available RAM; an explicit
    request that cannot fit in the available RAM is a ValueError naming `-c`."""
    n_parallel = max(1, n_parallel)
    ctx = requested or cfg.context_length
    if available is None:
        return ContextFit(ctx, None)
    need = kv_cache_bytes(cfg, ctx, n_parallel, kv_dtype_bytes)
    if requested:
        if need > available:
            raise ValueError(f"-c {requested} needs {need / GIB:.1f} GiB of KV cache but only "
                             f"{available / GIB:.1f} GiB of RAM is available; choose a smaller -c N")
        return ContextFit(ctx, None)
    budget = available // 2
    if need <= budget:
        return ContextFit(ctx, None)
    # Largest multiple of 256 tokens per slot whose KV fits the budget (bisection: KV grows with ctx).
    lo, hi = 0, ctx // (256 * n_parallel)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if kv_cache_bytes(cfg, mid * 256 * n_parallel, n_parallel, kv_dtype_bytes) <= budget:
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        raise ValueError(f"the model's context length {ctx} needs {need / GIB:.1f} GiB of KV cache and not "
                         f"even 256 tokens per slot fit in half of the {available / GIB:.1f} GiB of available "
                         f"RAM; choose -c N and -np N explicitly")
    capped = lo * 256 * n_parallel
    note = (f"the model's context length {ctx} needs {need / GIB:.1f} GiB of KV cache, more than half of the "
            f"{available / GIB:.1f} GiB of available RAM: using a context of {capped} tokens "
            f"(pass -c N to choose)")
    return ContextFit(capped, note)
