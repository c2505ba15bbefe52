"""Helpers for the kernel tests: random quantized weights, float64 ground truth, ISA params."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hybridmoe.kernels as K
from hybridmoe.gguf.constants import GGMLType
from hybridmoe.kernels._lib import LIB

try:  # the project's own quantizer once it has landed, else llama.cpp's numpy reference
    from hybridmoe.quant.formats import quantize as _quantize
except ImportError:  # pragma: no cover - depends on the other module's progress
    from gguf.quants import quantize as _gguf_quantize

    def _quantize(x: np.ndarray, t: GGMLType) -> np.ndarray:
        import gguf

        return _gguf_quantize(x, gguf.GGMLQuantizationType(int(t)))


ALL_ISAS = ("scalar", "avx2", "avx512")


def isa_supported(name: str) -> bool:
    return K.available() and bool(LIB.hm_isa_supported(name.encode()))


def isa_params():
    """pytest params for every kernel variant; unsupported ones are skipped with the reason."""
    out = []
    for name in ALL_ISAS:
        marks = []
        if not K.available():
            marks.append(pytest.mark.skip(reason="compiled kernels not built (torch fallback only)"))
        elif not isa_supported(name):
            marks.append(pytest.mark.skip(reason=f"this CPU lacks the instructions of the {name} kernels"))
        out.append(pytest.param(name, marks=marks, id=name))
    return out


def quantized(rng: np.random.Generator, rows: int, k: int, t: GGMLType, scale: float = 1.0) -> np.ndarray:
    """Random float weights quantized to `t`: uint8 [rows, k/32*block_bytes]."""
    w = rng.standard_normal((rows, k), dtype=np.float32) * scale
    return np.ascontiguousarray(_quantize(w, t))


def dequant64(raw: np.ndarray, t: GGMLType) -> torch.Tensor:
    """Independent oracle: llama.cpp's numpy dequantizer (gguf-py), in float64."""
    import gguf

    return torch.from_numpy(gguf.quants.dequantize(np.asarray(raw), gguf.GGMLQuantizationType(int(t))).astype(np.float64))


def default_tol(fp32_tol: float, act: K.Activations) -> float:
    """The stated error of an exact mode: fp32_tol with fp32 activations, else that mode's bound
    (kernels.ACT16_REL_ERR, kernels.INT8X3_REL_ERR)."""
    if act == K.Activations.FP32:
        return fp32_tol
    return max(fp32_tol, K.INT8X3_REL_ERR if act == K.Activations.INT8X3 else K.ACT16_REL_ERR)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y - ref| / max |ref|; NaN anywhere makes it NaN, so `< tol` fails."""
    return ((y.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def make_experts(rng: np.random.Generator, E: int, H: int, I: int, t: GGMLType = GGMLType.MXFP4,
                 bias: bool = True, down_type: GGMLType | None = None) -> K.ExpertTensors:
    """Random experts: gate/up [E, I, H-bytes], down [E, H, I-bytes] (of down_type, default t),
    biases [E, I]/[E, H]."""
    td = t if down_type is None else down_type
    gate = quantized(rng, E * I, H, t).reshape(E, I, -1)
    up = quantized(rng, E * I, H, t).reshape(E, I, -1)
    down = quantized(rng, E * H, I, td, scale=0.5).reshape(E, H, -1)
    b = (lambda *s: torch.from_numpy(rng.standard_normal(s, dtype=np.float32))) if bias else (lambda *s: None)
    return K.ExpertTensors(gate, up, down, b(E, I), b(E, I), b(E, H), t, down_type=td)


def moe_reference64(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, ex: K.ExpertTensors,
                    alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """float64 ground truth, token by token, written independently of kernels.reference."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g = dequant64(ex.gate[e], ex.ggml_type) @ x[t].double()
            u = dequant64(ex.up[e], ex.ggml_type) @ x[t].double()
            if ex.gate_bias is not None:
                g, u = g + ex.gate_bias[e].double(), u + ex.up_bias[e].double()
            g = torch.clamp(g, max=limit)
            u = torch.clamp(u, min=-limit, max=limit)
            a = g * torch.sigmoid(alpha * g) * (u + 1)
            y = dequant64(ex.down[e], ex.down_type) @ a
            if ex.down_bias is not None:
                y = y + ex.down_bias[e].double()
            out[t] += float(wts[t, j]) * y
    return out


def routing(rng: np.random.Generator, T: int, k: int, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct random experts per token (int32) and softmax weights."""
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    w = torch.softmax(torch.from_numpy(rng.standard_normal((T, k), dtype=np.float32)), -1)
    return torch.from_numpy(ids), w
