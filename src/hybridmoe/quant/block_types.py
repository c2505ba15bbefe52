"""numpy reference layouts of ggml's other block types: Q4_0 Q4_1 Q5_0 Q5_1 IQ4_NL (32 elements a
block) and IQ4_XS Q2_K Q3_K Q4_K Q5_K Q6_K (256). formats.py dispatches here.

Every layout is a few f16 scales plus little bit fields, and each bit field is one pattern:
`unpack_bits(bytes, group, bits)` reads `group` consecutive bytes at a time and takes their
lowest `bits` first, then the next `bits`, ... (so element g*8/bits*group + s*group + l comes
from byte g*group + l, shift s*bits). docs/formats.md lists each type's fields and formula. The
float work is done in float32 in gguf.quants' order, e.g. Q4_K: (d*sc)*q - (dmin*m), so the
values are bit-exact with it (and with ggml's scalar dequantizers).
Arrays: b is uint8 [..., n_blocks, block_bytes]; values float32 [..., n_blocks, block_elems].
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hybridmoe.gguf.constants import BLOCK_SIZES, GGMLType

T = GGMLType
TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL, T.IQ4_XS,
         T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
# the non-linear 4-bit grid of IQ4_NL / IQ4_XS (ggml's kvalues_iq4nl)
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                      dtype=np.int8)
# types whose every element is (same f16 d) * (an int8): to_q8_0 rewrites them as Q8_0 exactly
Q8_0_EXACT_TYPES = (T.Q4_0, T.Q5_0, T.IQ4_NL)
# byte offsets of the f16 scale fields in one block (d, and dmin / m where the type has one)
F16_FIELDS: dict[GGMLType, tuple[int, ...]] = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.IQ4_NL: (0,), T.IQ4_XS: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


# ---- bit fields --------------------------------------------------------------------------------
def unpack_bits(b: np.ndarray, group: int, bits: int) -> np.ndarray:
    """uint8 [..., G*group] -> uint8 [..., G*(8/bits)*group] codes, in ggml's element order."""
    s, n = 8 // bits, b.shape[-1]
    shifts = np.arange(0, 8, bits, dtype=np.uint8).reshape(s, 1)
    v = (b.reshape(b.shape[:-1] + (n // group, 1, group)) >> shifts) & np.uint8((1 << bits) - 1)
    return v.reshape(b.shape[:-1] + (n * s,))


def pack_bits(v: np.ndarray, group: int, bits: int) -> np.ndarray:
    """Inverse of unpack_bits: uint8 codes < 2^bits [..., n] -> uint8 [..., n*bits/8]."""
    s, n = 8 // bits, v.shape[-1]
    shifts = np.arange(0, 8, bits, dtype=np.uint8).reshape(s, 1)
    w = v.astype(np.uint8).reshape(v.shape[:-1] + (n // (s * group), s, group)) << shifts
    return np.bitwise_or.reduce(w, axis=-2).reshape(v.shape[:-1] + (n // s,))


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The f16 field at byte `at` of each block, as float32 [..., n_blocks, 1]."""
    return b[..., at:at + 2].copy().view(np.float16).astype(np.float32)


def k_scales_unpack(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 scale bytes -> 8 six-bit scales and 8 six-bit mins (uint8 [..., 8] each):
    bytes 0-3 / 4-7 hold scales / mins 0-3 in their low 6 bits and the top 2 bits of scales /
    mins 4-7 in bits 6-7; byte 8+i holds the low 4 bits of scale 4+i (low nibble) and of min 4+i
    (high nibble)."""
    a, m, lo = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([a & 0x3F, (lo & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([m & 0x3F, (lo >> 4) | ((m >> 6) << 4)], axis=-1)
    return sc, mn


def k_scales_pack(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Inverse of k_scales_unpack (values 0..63)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    return np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
                           mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                           (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)], axis=-1)


# ---- integer codes of each element (shared by dequantize and to_q8_0) ------------------------
def _q4_0_ints(b: np.ndarray) -> np.ndarray:
    return unpack_bits(b[..., 2:18], 16, 4).astype(np.int8) - np.int8(8)


def _q5_0_ints(b: np.ndarray) -> np.ndarray:
    q = unpack_bits(b[..., 6:22], 16, 4) | (unpack_bits(b[..., 2:6], 1, 1) << 4)
    return q.astype(np.int8) - np.int8(16)


def _iq4_nl_ints(b: np.ndarray) -> np.ndarray:
    return IQ4_VALUES[unpack_bits(b[..., 2:18], 16, 4)]


def _sub(v: np.ndarray, n: int) -> np.ndarray:
    """[..., k*n] -> [..., k, n]: the sub-blocks one sub-scale covers."""
    return v.reshape(v.shape[:-1] + (v.shape[-1] // n, n))


def _flat(v: np.ndarray) -> np.ndarray:
    return v.reshape(v.shape[:-2] + (v.shape[-2] * v.shape[-1],))


# ---- dequantizers: uint8 [..., nb, bytes] -> float32 [..., nb, elems] ---------------------------
def _dq_q4_0(b):
    return _f16(b, 0) * _q4_0_ints(b).astype(np.float32)


def _dq_q4_1(b):
    return _f16(b, 0) * unpack_bits(b[..., 4:20], 16, 4).astype(np.float32) + _f16(b, 2)


def _dq_q5_0(b):
    return _f16(b, 0) * _q5_0_ints(b).astype(np.float32)


def _dq_q5_1(b):
    q = unpack_bits(b[..., 8:24], 16, 4) | (unpack_bits(b[..., 4:8], 1, 1) << 4)
    return _f16(b, 0) * q.astype(np.float32) + _f16(b, 2)


def _dq_iq4_nl(b):
    return _f16(b, 0) * _iq4_nl_ints(b).astype(np.float32)


def _dq_iq4_xs(b):
    ls = unpack_bits(b[..., 4:8], 1, 4) | (unpack_bits(b[..., 2:4], 1, 2) << 4)  # 8 x 6 bits
    dl = (_f16(b, 0) * (ls.astype(np.int8) - np.int8(32)).astype(np.float32))[..., None]
    q = IQ4_VALUES[unpack_bits(b[..., 8:136], 16, 4)].astype(np.float32)
    return _flat(dl * _sub(q, 32))


def _dq_q2_k(b):
    sc = b[..., 0:16]
    dl = (_f16(b, 80) * (sc & 0x0F).astype(np.float32))[..., None]
    ml = (_f16(b, 82) * (sc >> 4).astype(np.float32))[..., None]
    q = unpack_bits(b[..., 16:80], 32, 2).astype(np.float32)
    return _flat(dl * _sub(q, 16) - ml)


def _dq_q3_k(b):
    sc = unpack_bits(b[..., 96:104], 8, 4) | (unpack_bits(b[..., 104:108], 4, 2) << 4)
    dl = (_f16(b, 108) * (sc.astype(np.int8) - np.int8(32)).astype(np.float32))[..., None]
    low, high = unpack_bits(b[..., 32:96], 32, 2), unpack_bits(b[..., 0:32], 32, 1)
    q = (low.astype(np.int8) - ((high ^ 1) << 2).astype(np.int8)).astype(np.float32)
    return _flat(dl * _sub(q, 16))


def _dq_k_asym(b, q):
    sc, mn = k_scales_unpack(b[..., 4:16])
    dl = (_f16(b, 0) * sc.astype(np.float32))[..., None]
    ml = (_f16(b, 2) * mn.astype(np.float32))[..., None]
    return _flat(dl * _sub(q.astype(np.float32), 32) - ml)


def _dq_q4_k(b):
    return _dq_k_asym(b, unpack_bits(b[..., 16:144], 32, 4))


def _dq_q5_k(b):
    q = unpack_bits(b[..., 48:176], 32, 4) | (unpack_bits(b[..., 16:48], 32, 1) << 4)
    return _dq_k_asym(b, q)


def _dq_q6_k(b):
    dl = (_f16(b, 208) * b[..., 192:208].view(np.int8).astype(np.float32))[..., None]
    q = unpack_bits(b[..., 0:128], 64, 4) | (unpack_bits(b[..., 128:192], 32, 2) << 4)
    return _flat(dl * _sub((q.astype(np.int8) - np.int8(32)).astype(np.float32), 16))


_DEQUANT: dict[GGMLType, Callable[[np.ndarray], np.ndarray]] = {
    T.Q4_0: _dq_q4_0, T.Q4_1: _dq_q4_1, T.Q5_0: _dq_q5_0, T.Q5_1: _dq_q5_1, T.IQ4_NL: _dq_iq4_nl,
    T.IQ4_XS: _dq_iq4_xs, T.Q2_K: _dq_q2_k, T.Q3_K: _dq_q3_k, T.Q4_K: _dq_q4_k, T.Q5_K: _dq_q5_k,
    T.Q6_K: _dq_q6_k}


def dequantize_blocks(b: np.ndarray, t: GGMLType) -> np.ndarray:
    """uint8 [..., nb, block_bytes] of a type in TYPES -> float32 [..., nb, block_elems]."""
    return _DEQUANT[t](b)


def to_q8_0_blocks(b: np.ndarray, t: GGMLType) -> np.ndarray:
    """[..., nb, block_bytes] of a type in Q8_0_EXACT_TYPES -> Q8_0 blocks [..., nb, 34]: the
    same f16 d bytes, then each element's integer (Q4_0 q-8, Q5_0 q-16, IQ4_NL its grid value)."""
    ints = {T.Q4_0: _q4_0_ints, T.Q5_0: _q5_0_ints, T.IQ4_NL: _iq4_nl_ints}[t](b)
    return np.concatenate([b[..., 0:2], ints.view(np.uint8)], axis=-1)


# ---- quantizers: float32 [..., nb, elems] (finite) -> uint8 [..., nb, bytes] --------------------
def _legacy_via_gguf(x: np.ndarray, t: GGMLType) -> np.ndarray:
    """ggml's reference quantizer as gguf.quants has it (bit-exact with quantize_row_*_ref)."""
    import gguf.quants  # imported here: it is slow to import and only writers need it

    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        q = gguf.quants.quantize(x.reshape(-1, x.shape[-1]), gguf.GGMLQuantizationType(int(t)))
    return np.asarray(q, np.uint8).reshape(x.shape[:-1] + (BLOCK_SIZES[t][1],))


def _inv(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _extreme(v: np.ndarray) -> np.ndarray:
    """The signed element of largest magnitude along the last axis, kept as [..., 1]."""
    return np.take_along_axis(v, np.abs(v).argmax(axis=-1)[..., None], axis=-1)


def _super_unsigned(s: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Sub-block scales s >= 0 [..., k] -> (f16 super-scale d [..., 1], codes 0..top [..., k])."""
    d = (s.max(axis=-1, keepdims=True) / np.float32(top)).astype(np.float16)
    codes = np.clip(np.rint(s * _inv(d.astype(np.float32))), 0, top)
    return d, codes.astype(np.uint8)


def _super_signed(s: np.ndarray, lo: int) -> tuple[np.ndarray, np.ndarray]:
    """Signed sub-block scales [..., k] -> (f16 d [..., 1], codes lo..-lo-1 [..., k]); the
    largest-magnitude scale maps to code `lo` (lo < 0)."""
    d = (_extreme(s) / np.float32(lo)).astype(np.float16)
    codes = np.clip(np.rint(s * _inv(d.astype(np.float32))), lo, -lo - 1)
    return d, codes.astype(np.int16)


def _nearest_iq4(v: np.ndarray) -> np.ndarray:
    """Index of the nearest IQ4 grid value (ties to the lower one) for each float."""
    grid = IQ4_VALUES.astype(np.float32)
    hi = np.clip(np.searchsorted(grid, v), 1, 15)
    return np.where(grid[hi] - v < v - grid[hi - 1], hi, hi - 1).astype(np.uint8)


def _k_asym(x: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 8 sub-blocks of 32 with an unsigned scale and min each -> (header bytes
    d|dmin|scales [..., 16], codes 0..top [..., 256])."""
    xs = _sub(x, 32)
    lo = np.minimum(xs.min(axis=-1), 0)
    dmin, mn = _super_unsigned(-lo, 63)
    m_eff = dmin.astype(np.float32) * mn.astype(np.float32)
    d, sc = _super_unsigned((xs.max(axis=-1) + m_eff) / np.float32(top), 63)
    dl = d.astype(np.float32) * sc.astype(np.float32)
    q = np.clip(np.rint((xs + m_eff[..., None]) * _inv(dl)[..., None]), 0, top).astype(np.uint8)
    head = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), k_scales_pack(sc, mn)], -1)
    return head, _flat(q)


def _q_q4_k(x):
    head, q = _k_asym(x, 15)
    return np.concatenate([head, pack_bits(q, 32, 4)], axis=-1)


def _q_q5_k(x):
    head, q = _k_asym(x, 31)
    return np.concatenate([head, pack_bits(q >> 4, 32, 1), pack_bits(q & 0x0F, 32, 4)], axis=-1)


def _q_q2_k(x):
    xs = _sub(x, 16)
    lo = np.minimum(xs.min(axis=-1), 0)
    dmin, mn = _super_unsigned(-lo, 15)
    m_eff = dmin.astype(np.float32) * mn.astype(np.float32)
    d, sc = _super_unsigned((xs.max(axis=-1) + m_eff) / np.float32(3), 15)
    dl = d.astype(np.float32) * sc.astype(np.float32)
    q = np.clip(np.rint((xs + m_eff[..., None]) * _inv(dl)[..., None]), 0, 3).astype(np.uint8)
    return np.concatenate([sc | (mn << 4), pack_bits(_flat(q), 32, 2),
                           d.view(np.uint8), dmin.view(np.uint8)], axis=-1)


def _signed_sub(x: np.ndarray, n: int, qlo: int, slo: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Symmetric types: sub-blocks of n whose largest-magnitude value maps to level qlo, signed
    sub-scale codes slo..-slo-1 -> (f16 d [..., 1], scale codes [..., k], per-element x/scale)."""
    xs = _sub(x, n)
    d, sc = _super_signed(_extreme(xs)[..., 0] / np.float32(qlo), slo)
    dl = d.astype(np.float32) * sc.astype(np.float32)
    return d, sc, xs * _inv(dl)[..., None]


def _q_q3_k(x):
    d, sc, v = _signed_sub(x, 16, -4, -32)
    u = (_flat(np.clip(np.rint(v), -4, 3)) + 4).astype(np.uint8)  # 0..7; bit 2 set = no -4
    us = (sc + 32).astype(np.uint8)
    return np.concatenate([pack_bits(u >> 2, 32, 1), pack_bits(u & 3, 32, 2),
                           pack_bits(us & 0x0F, 8, 4), pack_bits(us >> 4, 4, 2),
                           d.view(np.uint8)], axis=-1)


def _q_q6_k(x):
    d, sc, v = _signed_sub(x, 16, -32, -128)
    u = (_flat(np.clip(np.rint(v), -32, 31)) + 32).astype(np.uint8)  # 0..63
    return np.concatenate([pack_bits(u & 0x0F, 64, 4), pack_bits(u >> 4, 32, 2),
                           sc.astype(np.int8).view(np.uint8), d.view(np.uint8)], axis=-1)


def _q_iq4_xs(x):
    d, sc, v = _signed_sub(x, 32, -127, -32)
    us = (sc + 32).astype(np.uint8)
    return np.concatenate([d.view(np.uint8), pack_bits(us >> 4, 1, 2), pack_bits(us & 0x0F, 1, 4),
                           pack_bits(_flat(_nearest_iq4(v)), 16, 4)], axis=-1)


def _q_iq4_nl(x):
    d = (_extreme(x) / np.float32(-127)).astype(np.float16)
    q = _nearest_iq4(x * _inv(d.astype(np.float32)))
    return np.concatenate([d.view(np.uint8), pack_bits(q, 16, 4)], axis=-1)


_QUANT: dict[GGMLType, Callable[[np.ndarray], np.ndarray]] = {
    T.IQ4_NL: _q_iq4_nl, T.IQ4_XS: _q_iq4_xs, T.Q2_K: _q_q2_k, T.Q3_K: _q_q3_k, T.Q4_K: _q_q4_k,
    T.Q5_K: _q_q5_k, T.Q6_K: _q_q6_k}


def quantize_blocks(x: np.ndarray, t: GGMLType) -> np.ndarray:
    """float32 [..., nb, block_elems] (finite) -> uint8 [..., nb, block_bytes] of type t.

    Q4_0/Q4_1/Q5_0/Q5_1: ggml's reference quantizers (through gguf.quants, bit for bit). The
    others, which gguf cannot write: a plain one-pass quantizer, not llama-quantize's search:
    sub-block extremes give float sub-scales (and mins), those become codes relative to the f16
    super-block scale, and each value goes to the nearest level under the stored scales.
    """
    if t in _QUANT:
        with np.errstate(over="ignore", invalid="ignore"):
            return _QUANT[t](x)
    return _legacy_via_gguf(x, t)
