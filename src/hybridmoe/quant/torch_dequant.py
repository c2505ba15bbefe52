"""torch twins of quant.formats.dequantize (bit-exact), for tensors converted once and GPU tensors.

Same layouts as formats.py; works on any device the input lives on.
"""

from __future__ import annotations

import torch

from hybridmoe.gguf.constants import BLOCK_SIZES, GGMLType
from hybridmoe.quant.formats import MXFP4_LUT2, check_type, count_blocks

_LUT2 = torch.tensor(MXFP4_LUT2.tolist(), dtype=torch.float32)
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
