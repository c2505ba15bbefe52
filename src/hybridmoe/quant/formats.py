"""numpy reference (de)quantizers for the ggml types we read: F32, F16, BF16, Q8_0, MXFP4 here,
and Q4_0 Q4_1 Q5_0 Q5_1 IQ4_NL IQ4_XS Q2_K Q3_K Q4_K Q5_K Q6_K in block_types.py.

These are the spec the fast kernels are tested against. Layouts (ggml-common.h facts, see
docs/formats.md):
  Q8_0  34 B / 32: f16 d, int8 qs[32];            w[j] = d * qs[j]
  MXFP4 17 B / 32: u8 e (E8M0), u8 qs[16];         w[j] = LUT2[qs[j] & 15] * 2^(e-128),
                                                   w[j+16] = LUT2[qs[j] >> 4] * 2^(e-128)
where LUT2 is the doubled E2M1 table, so 2^(e-128) * LUT2 == 2^(e-127) * E2M1.
Arrays: raw is uint8 with the last axis in bytes (a whole number of blocks); values are float32
with the last axis in elements. Leading axes pass through.
"""

from __future__ import annotations

import numpy as np

from hybridmoe.gguf.constants import BLOCK_SIZES, GGMLType
from hybridmoe.quant import block_types
from hybridmoe.quant.block_types import Q8_0_EXACT_TYPES

MXFP4_LUT2 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)
_MXFP4_MAGS = MXFP4_LUT2[:8].astype(np.float32)  # codes 0..7 (and 8..15 negated)
SUPPORTED = (GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.MXFP4,
             *block_types.TYPES)
_NATIVE_DTYPES = {GGMLType.F32: np.float32, GGMLType.F16: np.float16, GGMLType.BF16: np.uint16}


def check_type(t: GGMLType | int, what: str) -> GGMLType:
    """`t` as a GGMLType this package decodes; ValueError naming `what` otherwise (shared by the twins)."""
    try:
        t = GGMLType(t)
    except ValueError:
        raise ValueError(f"{what}: unknown ggml type id {t}") from None
    if t not in SUPPORTED:
        raise ValueError(f"{what}: type {t.name} not supported "
                         f"(supported: {', '.join(s.name for s in SUPPORTED)})")
    return t


def _as_blocks(raw: np.ndarray, t: GGMLType, what: str = "dequantize") -> np.ndarray:
    """uint8 [..., row_bytes] -> [..., n_blocks, block_bytes]; native typed views accepted too."""
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        if raw.dtype != _NATIVE_DTYPES.get(t):
            raise ValueError(f"{what} {t.name}: raw must be uint8 bytes, got {raw.dtype}")
        raw = np.ascontiguousarray(raw).view(np.uint8)
    if raw.ndim == 0:
        raise ValueError(f"{what} {t.name}: raw must have at least one axis (bytes)")
    nb = count_blocks(raw.shape[-1], t, what)
    return np.ascontiguousarray(raw).reshape(raw.shape[:-1] + (nb, BLOCK_SIZES[t][1]))


def count_blocks(row_bytes: int, t: GGMLType, what: str) -> int:
    """Blocks in a bytes axis of `row_bytes`; ValueError naming `what` when not a whole number."""
    bb = BLOCK_SIZES[t][1]
    if row_bytes % bb:
        raise ValueError(f"{what} {t.name}: last axis of {row_bytes} bytes is not a multiple of the "
                         f"{bb}-byte block")
    return row_bytes // bb


def e8m0_to_fp32_half(e: np.ndarray) -> np.ndarray:
    """2^(e-128) as float32, exact down to e = 0 (a subnormal); e = 255 gives 2^127, as ggml."""
    e = np.asarray(e, dtype=np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def dequantize(raw: np.ndarray, t: GGMLType | int) -> np.ndarray:
    """uint8 [..., row_bytes] of type `t` -> float32 [..., row_elems].

    Stored inf/NaN scales propagate, and MXFP4 codes +-6 with e >= 254 overflow to inf, as in ggml.
    """
    t = check_type(t, "dequantize")
    b = _as_blocks(raw, t)
    with np.errstate(over="ignore", invalid="ignore"):
        return _dequantize_blocks(b, t)


def _dequantize_blocks(b: np.ndarray, t: GGMLType) -> np.ndarray:
    lead = b.shape[:-2]
    if t in block_types.TYPES:
        n = b.shape[-2] * BLOCK_SIZES[t][0]
        return block_types.dequantize_blocks(b, t).reshape(lead + (n,))
    if t == GGMLType.F32:
        return b.reshape(lead + (-1,)).view(np.float32).copy()
    if t == GGMLType.F16:
        return b.reshape(lead + (-1,)).view(np.float16).astype(np.float32)
    if t == GGMLType.BF16:
        u16 = b.reshape(lead + (-1,)).view(np.uint16)
        return (u16.astype(np.uint32) << np.uint32(16)).view(np.float32)
    if t == GGMLType.Q8_0:
        d = b[..., :2].copy().view(np.float16).astype(np.float32)  # [..., nb, 1]
        qs = b[..., 2:].view(np.int8).astype(np.float32)  # [..., nb, 32]
        return (qs * d).reshape(lead + (-1,))
    # MXFP4
    d = e8m0_to_fp32_half(b[..., 0])[..., None]  # [..., nb, 1]
    qs = b[..., 1:]  # [..., nb, 16]
    lut = MXFP4_LUT2.astype(np.float32)
    w = np.concatenate([lut[qs & 0x0F], lut[qs >> 4]], axis=-1)  # [..., nb, 32]
    return (w * d).reshape(lead + (-1,))


def _as_rows(x: np.ndarray, t: GGMLType, block: int) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % block:
        raise ValueError(f"quantize {t.name}: last axis ({x.shape[-1:] or 'scalar'}) must be a "
                         f"multiple of {block}")
    return x


def _round_half_away(v: np.ndarray) -> np.ndarray:
    # like C roundf; computed as floor + (fraction >= .5) so no float rounding sneaks in
    a = np.abs(v)
    f = np.floor(a)
    return np.copysign(f + (a - f >= 0.5), v)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """float32 [..., n] -> Q8_0 bytes [..., n/32*34]; d = amax/127, q = round(x/d) (ggml's ref)."""
    qk = BLOCK_SIZES[GGMLType.Q8_0][0]
    x = _as_rows(x, GGMLType.Q8_0, qk)
    blocks = x.reshape(x.shape[:-1] + (-1, qk))
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    qs = _round_half_away(blocks * inv).astype(np.int8)
    out = np.concatenate([d.astype(np.float16).view(np.uint8), qs.view(np.uint8)], axis=-1)
    return out.reshape(x.shape[:-1] + (-1,))


def quantize_mxfp4(x: np.ndarray) -> np.ndarray:
    """float32 [..., n] -> MXFP4 bytes [..., n/32*17].

    Shared exponent as ggml's reference: e = floor(log2(amax)) - 2 + 127 (clamped to 0..254),
    then each element goes to the nearest representable value (ties to the smaller magnitude).
    """
    qk = BLOCK_SIZES[GGMLType.MXFP4][0]
    x = _as_rows(x, GGMLType.MXFP4, qk)
    if not np.all(np.isfinite(x)):
        raise ValueError("quantize MXFP4: input holds NaN or inf")
    blocks = x.reshape(-1, qk)
    amax = np.abs(blocks).max(axis=-1)
    with np.errstate(divide="ignore"):
        exp = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0)
    e = np.clip(exp, 0, 254).astype(np.uint8)
    d = e8m0_to_fp32_half(e)[:, None]
    a = np.abs(blocks)
    hi = np.clip(np.searchsorted(_MXFP4_MAGS, a / d), 1, 7)
    lo = hi - 1
    err_lo = np.abs(d * _MXFP4_MAGS[lo] - a)
    err_hi = np.abs(d * _MXFP4_MAGS[hi] - a)
    idx = np.where(err_hi < err_lo, hi, lo).astype(np.uint8)
    codes = np.where((blocks < 0) & (idx > 0), idx + 8, idx).astype(np.uint8)  # [nb, 32]
    qs = codes[:, :16] | (codes[:, 16:] << 4)
    out = np.concatenate([e[:, None], qs], axis=-1)
    return out.reshape(x.shape[:-1] + (-1,))


def quantize_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bytes, round to nearest even; NaN stays a (quiet) NaN."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return np.where(is_nan, (u >> 16) | 0x40, r).astype(np.uint16).view(np.uint8)


def quantize_block_type(x: np.ndarray, t: GGMLType) -> np.ndarray:
    """float32 [..., n] -> uint8 [..., row_bytes] for the types of block_types (see its
    quantize_blocks for the method); refuses NaN/inf input and values whose f16 scale overflows."""
    qk, bb = BLOCK_SIZES[t]
    x = _as_rows(x, t, qk)
    if not np.all(np.isfinite(x)):
        raise ValueError(f"quantize {t.name}: input holds NaN or inf")
    blocks = np.ascontiguousarray(x).reshape(x.shape[:-1] + (x.shape[-1] // qk, qk))
    if blocks.size == 0:
        return np.zeros(x.shape[:-1] + (x.shape[-1] // qk * bb,), np.uint8)
    out = block_types.quantize_blocks(blocks, t)
    for at in block_types.F16_FIELDS[t]:
        if not np.all(np.isfinite(out[..., at:at + 2].copy().view(np.float16))):
            raise ValueError(f"quantize {t.name}: values up to {np.abs(x).max():.3g} overflow "
                             "the f16 block scale")
    return out.reshape(x.shape[:-1] + (-1,))


def to_q8_0(raw: np.ndarray, t: GGMLType | int) -> np.ndarray:
    """Rewrite Q4_0 / Q5_0 / IQ4_NL bytes [..., row_bytes] as Q8_0 bytes [..., n/32*34], exactly:
    each of these blocks is one f16 d times 32 small integers, which Q8_0 stores as they are, so
    dequantize(to_q8_0(raw, t), Q8_0) == dequantize(raw, t) bit for bit and the Q8_0 kernels
    can run them."""
    t = check_type(t, "to_q8_0")
    if t not in Q8_0_EXACT_TYPES:
        raise ValueError(f"to_q8_0: type {t.name} has no exact Q8_0 form "
                         f"(only {', '.join(s.name for s in Q8_0_EXACT_TYPES)})")
    b = _as_blocks(raw, t, "to_q8_0")
    return block_types.to_q8_0_blocks(b, t).reshape(b.shape[:-2] + (b.shape[-2] * 34,))


def quantize(x: np.ndarray, t: GGMLType | int) -> np.ndarray:
    """float32 [..., n] -> uint8 [..., row_bytes] of type `t`."""
    t = check_type(t, "quantize")
    if t in block_types.TYPES:
        return quantize_block_type(x, t)
    if t == GGMLType.F32:
        return np.ascontiguousarray(_as_rows(x, t, 1)).view(np.uint8)
    if t == GGMLType.F16:
        with np.errstate(over="ignore"):  # |x| > 65504 becomes inf, as in ggml
            return _as_rows(x, t, 1).astype(np.float16).view(np.uint8)
    if t == GGMLType.BF16:
        return quantize_bf16(_as_rows(x, t, 1))
    if t == GGMLType.Q8_0:
        return quantize_q8_0(x)
    return quantize_mxfp4(x)


def mxfp4_from_hf(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """HF/OpenAI MXFP4 -> ggml MXFP4 bytes.

    blocks: uint8 [..., nb, 16], byte k = element 2k (low nibble) | element 2k+1 (high nibble);
    scales: uint8 [..., nb] (E8M0, value 2^(s-127)). Returns uint8 [..., nb*17], in ggml order
    (qs[j] = element j low | element j+16 high) with the scale byte unchanged in front.
    """
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"mxfp4_from_hf: blocks/scales must be uint8, got {blocks.dtype}/"
                         f"{scales.dtype}")
    if blocks.shape[-1:] != (16,) or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"mxfp4_from_hf: blocks {blocks.shape} must be scales {scales.shape} + (16,)")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(blocks.shape[:-1] + (32,))
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    out = np.concatenate([scales[..., None], qs], axis=-1)  # [..., nb, 17]
    return out.reshape(scales.shape[:-1] + (-1,))
