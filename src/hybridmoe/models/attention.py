"""Attention backends (rope, KV-cache write, attention with sinks), one picked per layer at load.

`TorchAttention` runs anywhere, on any KV dtype. `KernelDecodeAttention` is picked for a layer on
the CPU with a float32 cache and the compiled kernels: a one-token chunk (a decode step) does
rope, cache write and attention in one C call instead of ~40 small torch ops.
"""

from __future__ import annotations

import torch

from hybridmoe import kernels
from hybridmoe.models.layers import apply_rope_neox, attention_with_sinks
from hybridmoe.models.step import SeqChunk, StepBatch


class TorchAttention:
    """Sliding-window (window set) or full causal GQA attention with one sink logit per head."""

    def __init__(self, layer: int, sinks: torch.Tensor, scale: float, window: int | None):
        self.layer = layer
        self.sinks = sinks
        self.scale = scale
        self.window = window

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepBatch) -> torch.Tensor:
        """q [N, Hq, d], k / v [N, Hkv, d] for all rows of the step -> [N, Hq, d]."""
        cos, sin, q_pos = step.tables(q.device)
        outs, off = [], 0
        for c, n, pos0, qp in zip(step.chunks, step.lens, step.pos0s, q_pos):
            rows = slice(off, off + n)
            outs.append(self.chunk(c, pos0, q[rows], k[rows], v[rows], cos[rows], sin[rows], qp))
            off += n
        return torch.cat(outs)

    def chunk(self, c: SeqChunk, pos0: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        """One sequence's rows: rope, append to its cache, attend over what the cache holds."""
        q, k = apply_rope_neox(q, cos, sin), apply_rope_neox(k, cos, sin)
        k_all, v_all, k_pos = c.cache.update(self.layer, k, v, pos0)
        return attention_with_sinks(q, k_all, v_all, self.sinks, q_pos, k_pos, self.scale, self.window,
                                    keys_in_order=self.window is None)


class KernelDecodeAttention(TorchAttention):
    """TorchAttention whose one-token chunks go through kernels.attn_decode (float32 CPU cache)."""

    def chunk(self, c: SeqChunk, pos0: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        if q.shape[0] != 1:
            return super().chunk(c, pos0, q, k, v, cos, sin, q_pos)
        kc, vc, kpos, row, n_keys = c.cache.decode_row(self.layer, pos0)
        return kernels.attn_decode(q[0], k[0], v[0], cos[0, 0], sin[0, 0], kc, vc, row, kpos, pos0, n_keys,
                                   self.window or 0, self.sinks, self.scale)[None]


def kv_dtype_for(layer_devices: list[torch.device], accelerator_dtype: torch.dtype) -> torch.dtype:
    """KV in float32 when every layer is on the CPU (exact, and what the C decode attention
    reads); else the plan's choice (float32, or float16 where VRAM is short or with --fast-math)."""
    return torch.float32 if all(d.type == "cpu" for d in layer_devices) else accelerator_dtype


def pick_attention(layer: int, device: torch.device, kv_dtype: torch.dtype, sinks: torch.Tensor, scale: float,
                   window: int | None) -> TorchAttention:
    """The C decode kernel where it applies (CPU layer, float32 cache, library loaded), else torch."""
    if device.type == "cpu" and kv_dtype == torch.float32 and kernels.available():
        return KernelDecodeAttention(layer, sinks, scale, window)
    return TorchAttention(layer, sinks, scale, window)
