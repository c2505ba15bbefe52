"""torch twins of quant.formats.dequantize (bit-exact), for tensors converted once and GPU tensors.

Same layouts as formats.py / block_types.py; pure torch ops, so it works on any device the input
lives on. Bit fields are cut in int32 (shifts and masks CUDA has for every dtype), and the float
work is the numpy reference's float32 ops in its order, one op at a time (no fused multiply-add).
"""

from __future__ import annotations

import torch

from hybridmoe.gguf.constants import BLOCK_SIZES, GGMLType
from hybridmoe.quant.block_types import IQ4_VALUES, TYPES
from hybridmoe.quant.formats import MXFP4_LUT2, check_type, count_blocks

_LUT2 = torch.tensor(MXFP4_LUT2.tolist(), dtype=torch.float32)
_IQ4 = torch.tensor(IQ4_VALUES.tolist(), dtype=torch.float32)
_FLOAT_VIEWS = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16,
                GGMLType.BF16: torch.bfloat16}


def e8m0_to_fp32_half_torch(e: torch.Tensor) -> torch.Tensor:
    """2^(e-128) as float32 from uint8 exponents (same bit construction as ggml)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.bitwise_left_shift(torch.full_like(e, 0x00200000), e),
                       torch.bitwise_left_shift(e - 1, 23))
    return bits.view(torch.float32)


def dequantize_torch(raw: torch.Tensor, t: GGMLType | int) -> torch.Tensor:
    """uint8 [..., row_bytes] of type `t` -> float32 [..., row_elems] (a new tensor)."""
    t = check_type(t, "dequantize_torch")
    if raw.dtype != torch.uint8 or raw.dim() == 0:
        raise ValueError(f"dequantize_torch {t.name}: raw must be a uint8 tensor with a bytes "
                         f"axis, got {raw.dtype} {tuple(raw.shape)}")
    nb = count_blocks(raw.shape[-1], t, "dequantize_torch")
    raw = raw.contiguous()
    lead = tuple(raw.shape[:-1])
    if t in _FLOAT_VIEWS:
        return raw.view(_FLOAT_VIEWS[t]).to(torch.float32, copy=True)
    b = raw.reshape(lead + (nb, BLOCK_SIZES[t][1]))
    if t in TYPES:
        return _DEQUANT[t](b).reshape(lead + (nb * BLOCK_SIZES[t][0],))
    if t == GGMLType.Q8_0:
        d = b[..., :2].contiguous().view(torch.float16).to(torch.float32)  # [..., nb, 1]
        qs = b[..., 2:].contiguous().view(torch.int8).to(torch.float32)  # [..., nb, 32]
        return (qs * d).reshape(lead + (-1,))
    # MXFP4
    d = e8m0_to_fp32_half_torch(b[..., 0]).unsqueeze(-1)  # [..., nb, 1]
    qs = b[..., 1:].to(torch.int64)  # [..., nb, 16]
    lut = _LUT2.to(raw.device)
    w = torch.cat([lut[qs & 0x0F], lut[qs >> 4]], dim=-1)  # [..., nb, 32]
    return (w * d).reshape(lead + (-1,))


# ---- the block_types layouts (see block_types.py for the field pattern) -------------------------
def _bits(b: torch.Tensor, lo: int, hi: int, group: int, bits: int) -> torch.Tensor:
    """Bytes lo:hi of each block -> int32 codes in element order (block_types.unpack_bits)."""
    v = b[..., lo:hi].to(torch.int32)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=b.device).view(-1, 1)
    n = hi - lo
    v = (v.reshape(*v.shape[:-1], n // group, 1, group) >> shifts) & ((1 << bits) - 1)
    return v.reshape(*v.shape[:-3], n * (8 // bits))


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 field at byte `at` of each block, as float32 [..., nb, 1]."""
    return b[..., at:at + 2].contiguous().view(torch.float16).to(torch.float32)


def _f(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float32)


def _sub(v: torch.Tensor, n: int) -> torch.Tensor:
    return v.reshape(*v.shape[:-1], v.shape[-1] // n, n)


def _flat(v: torch.Tensor) -> torch.Tensor:
    return v.reshape(*v.shape[:-2], v.shape[-2] * v.shape[-1])


def _iq4(q: torch.Tensor) -> torch.Tensor:
    return _IQ4.to(q.device)[q.to(torch.int64)]


def _dq_k_asym(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    a, m, lo = (b[..., i:i + 4].to(torch.int32) for i in (4, 8, 12))
    sc = torch.cat([a & 0x3F, (lo & 0x0F) | ((a >> 6) << 4)], dim=-1)
    mn = torch.cat([m & 0x3F, (lo >> 4) | ((m >> 6) << 4)], dim=-1)
    dl = (_f16(b, 0) * _f(sc)).unsqueeze(-1)
    ml = (_f16(b, 2) * _f(mn)).unsqueeze(-1)
    return _flat(dl * _sub(_f(q), 32) - ml)


def _dq_q3_k(b: torch.Tensor) -> torch.Tensor:
    sc = _bits(b, 96, 104, 8, 4) | (_bits(b, 104, 108, 4, 2) << 4)
    dl = (_f16(b, 108) * _f(sc - 32)).unsqueeze(-1)
    q = _bits(b, 32, 96, 32, 2) - ((_bits(b, 0, 32, 32, 1) ^ 1) << 2)
    return _flat(dl * _sub(_f(q), 16))


def _dq_q2_k(b: torch.Tensor) -> torch.Tensor:
    sc = b[..., 0:16].to(torch.int32)
    dl = (_f16(b, 80) * _f(sc & 0x0F)).unsqueeze(-1)
    ml = (_f16(b, 82) * _f(sc >> 4)).unsqueeze(-1)
    return _flat(dl * _sub(_f(_bits(b, 16, 80, 32, 2)), 16) - ml)


def _dq_q6_k(b: torch.Tensor) -> torch.Tensor:
    dl = (_f16(b, 208) * _f(b[..., 192:208].contiguous().view(torch.int8))).unsqueeze(-1)
    q = (_bits(b, 0, 128, 64, 4) | (_bits(b, 128, 192, 32, 2) << 4)) - 32
    return _flat(dl * _sub(_f(q), 16))


def _dq_iq4_xs(b: torch.Tensor) -> torch.Tensor:
    ls = _bits(b, 4, 8, 1, 4) | (_bits(b, 2, 4, 1, 2) << 4)
    dl = (_f16(b, 0) * _f(ls - 32)).unsqueeze(-1)
    return _flat(dl * _sub(_iq4(_bits(b, 8, 136, 16, 4)), 32))


_DEQUANT = {
    GGMLType.Q4_0: lambda b: _f16(b, 0) * _f(_bits(b, 2, 18, 16, 4) - 8),
    GGMLType.Q4_1: lambda b: _f16(b, 0) * _f(_bits(b, 4, 20, 16, 4)) + _f16(b, 2),
    GGMLType.Q5_0: lambda b: _f16(b, 0) * _f((_bits(b, 6, 22, 16, 4) | (_bits(b, 2, 6, 1, 1) << 4))
                                             - 16),
    GGMLType.Q5_1: lambda b: (_f16(b, 0) * _f(_bits(b, 8, 24, 16, 4) | (_bits(b, 4, 8, 1, 1) << 4))
                              + _f16(b, 2)),
    GGMLType.IQ4_NL: lambda b: _f16(b, 0) * _iq4(_bits(b, 2, 18, 16, 4)),
    GGMLType.IQ4_XS: _dq_iq4_xs,
    GGMLType.Q2_K: _dq_q2_k,
    GGMLType.Q3_K: _dq_q3_k,
    GGMLType.Q4_K: lambda b: _dq_k_asym(b, _bits(b, 16, 144, 32, 4)),
    GGMLType.Q5_K: lambda b: _dq_k_asym(b, _bits(b, 48, 176, 32, 4)
                                        | (_bits(b, 16, 48, 32, 1) << 4)),
    GGMLType.Q6_K: _dq_q6_k,
}


def mxfp4_from_hf(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """torch twin of quant.formats.mxfp4_from_hf (HF/OpenAI MXFP4 -> ggml 17-byte blocks).

    blocks uint8 [..., nb, 16] (byte k = element 2k low | 2k+1 high), scales uint8 [..., nb]
    -> uint8 [..., nb*17] with qs[j] = element j low | element j+16 high, scale byte first.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4_from_hf: blocks/scales must be uint8, got {blocks.dtype}/"
                         f"{scales.dtype}")
    if tuple(blocks.shape[-1:]) != (16,) or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"mxfp4_from_hf: blocks {tuple(blocks.shape)} must be scales "
                         f"{tuple(scales.shape)} + (16,)")
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    out = torch.cat([scales.unsqueeze(-1), qs], dim=-1)  # [..., nb, 17]
    return out.reshape(*scales.shape[:-1], -1)
