"""Plain-torch twins of the C++ kernels: the spec they are tested against, and the fallback when
the compiled library is missing. Slow on purpose: dequantize, then float32 matmul.

Block layouts (docs/formats.md): MXFP4 = e8m0 byte + 16 bytes of nibbles
(element j = low nibble of byte j, element j+16 = high nibble), value = LUT2[code] * 2^(e-128);
Q8_0 = fp16 scale + 32 int8.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridmoe.gguf.constants import GGMLType

# Doubled E2M1 values (ggml's kvalues_mxfp4); the e8m0 scale is halved to match.
_MXFP4_LUT2 = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)


def _as_uint8_tensor(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(raw, torch.Tensor):
        return raw
    return torch.from_numpy(np.ascontiguousarray(raw))


def dequant_mxfp4(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    """uint8 [..., n_blocks*17] -> float32 [..., n_blocks*32], exact."""
    b = _as_uint8_tensor(raw)
    if b.shape[-1] % 17:
        raise ValueError(f"MXFP4 rows must be a multiple of 17 bytes, got {b.shape[-1]}")
    b = b.reshape(*b.shape[:-1], -1, 17)
    e = b[..., 0].to(torch.int32)
    # 2^(e-128) built from float bits: exact for every byte, including the subnormal e = 0, 1.
    bits = torch.where(e >= 2, (e - 1) << 23, torch.tensor(0x00200000, dtype=torch.int32) << e)
    d = bits.view(torch.float32)
    qs = b[..., 1:].to(torch.int64)
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
    w = _MXFP4_LUT2[codes] * d.unsqueeze(-1)
    return w.reshape(*w.shape[:-2], -1)


def dequant_q8_0(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    """uint8 [..., n_blocks*34] -> float32 [..., n_blocks*32], exact."""
    b = _as_uint8_tensor(raw)
    if b.shape[-1] % 34:
        raise ValueError(f"Q8_0 rows must be a multiple of 34 bytes, got {b.shape[-1]}")
    b = b.reshape(*b.shape[:-1], -1, 34).contiguous()
    d = b[..., :2].view(torch.float16).to(torch.float32)
    q = b[..., 2:].view(torch.int8).to(torch.float32)
    w = q * d
    return w.reshape(*w.shape[:-2], -1)


def dequant(raw: np.ndarray | torch.Tensor, ggml_type: GGMLType | int) -> torch.Tensor:
    """Dequantize a block-quantized uint8 array (last axis bytes) to float32."""
    t = GGMLType(ggml_type)
    if t == GGMLType.MXFP4:
        return dequant_mxfp4(raw)
    if t == GGMLType.Q8_0:
        return dequant_q8_0(raw)
    from hybridmoe.quant.torch_dequant import dequantize_torch  # other types: the quant package

    return dequantize_torch(_as_uint8_tensor(raw), t)


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
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        xe = x[tok]
        g = linear(xe, experts.gate[e], experts.ggml_type, None if experts.gate_bias is None else experts.gate_bias[e])
        u = linear(xe, experts.up[e], experts.ggml_type, None if experts.up_bias is None else experts.up_bias[e])
        a = swiglu_oai(g, u, swiglu_alpha, swiglu_limit)
        y = linear(a, experts.down[e], experts.ggml_type, None if experts.down_bias is None else experts.down_bias[e])
        out.index_add_(0, tok, y * expert_weights[tok, slot].unsqueeze(1))
    return out
