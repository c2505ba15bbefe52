"""Plain-torch twins of the C++ kernels: the spec they are tested against, and the fallback when
the compiled library is missing. Slow on purpose: dequantize, then float32 matmul.

Dequantization is the quant package's torch twin (one decoder per format, docs/formats.md).
"""

from __future__ import annotations

import numpy as np
import torch

from hybridmoe.gguf.constants import GGMLType
from hybridmoe.quant.torch_dequant import dequantize_torch


def dequant(raw: np.ndarray | torch.Tensor, ggml_type: GGMLType | int) -> torch.Tensor:
    """uint8 [..., row_bytes] (numpy or torch) -> float32 [..., row_elems], bit-exact."""
    t = raw if isinstance(raw, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(raw))
    return dequantize_torch(t, ggml_type)


def linear(x: torch.Tensor, w_raw: np.ndarray, ggml_type: GGMLType | int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] f32 @ dequant(w_raw) [N, K]^T (+ bias [N]) -> [T, N] f32."""
    y = x @ dequant(w_raw, ggml_type).T
    return y + bias if bias is not None else y


def swiglu_oai(g: torch.Tensor, u: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss clamped SwiGLU: gate clamped above only, up both sides, (up + 1). NaN propagates."""
    g = torch.where(g > limit, torch.full_like(g, limit), g)
    u = torch.where(u > limit, torch.full_like(u, limit), torch.where(u < -limit, torch.full_like(u, -limit), u))
    return g * torch.sigmoid(alpha * g) * (u + 1)


def moe_forward(x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor, experts,
                swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> torch.Tensor:
    """Routed gpt-oss experts, one expert at a time: out[t] = sum_j w[t,j] * (down(act) + bd)."""
    T, _ = x.shape
    out = torch.zeros_like(x)
    ids = expert_ids.to(torch.int64)
    for e in torch.unique(ids).tolist():
        tok, choice = torch.nonzero(ids == e, as_tuple=True)  # token, and which of its k experts
        xe = x[tok]
        g = linear(xe, experts.gate[e], experts.ggml_type, None if experts.gate_bias is None else experts.gate_bias[e])
        u = linear(xe, experts.up[e], experts.ggml_type, None if experts.up_bias is None else experts.up_bias[e])
        a = swiglu_oai(g, u, swiglu_alpha, swiglu_limit)
        y = linear(a, experts.down[e], experts.down_type,
                   None if experts.down_bias is None else experts.down_bias[e])
        out.index_add_(0, tok, y * expert_weights[tok, choice].unsqueeze(1))
    return out
