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

    def __init__(self, layer: int, n_heads: int, sinks: torch.Tensor, scale: float, window: int | None):
        self.layer = layer
        self.n_heads = n_heads
        self.sinks = sinks
        self.scale = scale
        self.window = window

    def __call__(self, qkv: torch.Tensor, step: StepBatch) -> torch.Tensor:
        """qkv [N, Hq + 2 Hkv, d] (q heads, k heads, v heads) for all rows of the step -> [N, Hq, d].
        Rope runs once for q and k of every row (on an accelerator each op is a kernel launch)."""
        Hq = self.n_heads
        Hkv = (qkv.shape[1] - Hq) // 2
        cos, sin, q_pos = step.tables(qkv.device)
        qk = apply_rope_neox(qkv[:, : Hq + Hkv], cos, sin)
        q, k, v = qk[:, :Hq], qk[:, Hq:], qkv[:, Hq + Hkv:]
        outs, off = [], 0
        for c, n, pos0, qp in zip(step.chunks, step.lens, step.pos0s, q_pos):
            rows = slice(off, off + n)
            outs.append(self.attend(c, pos0, q[rows], k[rows], v[rows], qp))
            off += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def attend(self, c: SeqChunk, pos0: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               q_pos: torch.Tensor) -> torch.Tensor:
        """One sequence's rope'd rows: append to its cache, attend over what the cache holds."""
        k_all, v_all, k_pos = c.cache.update(self.layer, k, v, pos0)
        return attention_with_sinks(q, k_all, v_all, self.sinks, q_pos, k_pos, self.scale, self.window,
                                    keys_in_order=self.window is None, first_pos=pos0)


class KernelDecodeAttention(TorchAttention):
    """TorchAttention whose one-token chunks go through kernels.attn_decode (float32 CPU cache),
    which applies rope itself; longer chunks are rope'd here and attend in torch."""

    def __call__(self, qkv: torch.Tensor, step: StepBatch) -> torch.Tensor:
        Hq = self.n_heads
        Hkv = (qkv.shape[1] - Hq) // 2
        cos, sin, q_pos = step.tables(qkv.device)
        outs, off = [], 0
        for c, n, pos0, qp in zip(step.chunks, step.lens, step.pos0s, q_pos):
            rows = slice(off, off + n)
            x = qkv[rows]
            if n == 1:
                kc, vc, kpos, row, n_keys = c.cache.decode_row(self.layer, pos0)
                outs.append(kernels.attn_decode(x[0, :Hq], x[0, Hq:Hq + Hkv], x[0, Hq + Hkv:], cos[off, 0], sin[off, 0],
                                                kc, vc, row, kpos, pos0, n_keys, self.window or 0, self.sinks,
                                                self.scale)[None])
            else:
                qk = apply_rope_neox(x[:, : Hq + Hkv], cos[rows], sin[rows])
                outs.append(self.attend(c, pos0, qk[:, :Hq], qk[:, Hq:], x[:, Hq + Hkv:], qp))
            off += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def kv_dtype_for(layer_devices: list[torch.device], accelerator_dtype: torch.dtype) -> torch.dtype:
    """KV in float32 when every layer is on the CPU (exact, and what the C decode attention
    reads); else the plan's choice (float32, or float16 where VRAM is short or with --fast-math)."""
    return torch.float32 if all(d.type == "cpu" for d in layer_devices) else accelerator_dtype


def pick_attention(layer: int, device: torch.device, kv_dtype: torch.dtype, n_heads: int, sinks: torch.Tensor,
                   scale: float, window: int | None) -> TorchAttention:
    """The C decode kernel where it applies (CPU layer, float32 cache, library loaded), else torch."""
    if device.type == "cpu" and kv_dtype == torch.float32 and kernels.available():
        return KernelDecodeAttention(layer, n_heads, sinks, scale, window)
    return TorchAttention(layer, n_heads, sinks, scale, window)
