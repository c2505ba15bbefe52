"""How a kernel call multiplies its activations with quantized weights: the per-call mode and the
error each mode is held to."""

from __future__ import annotations

import enum

# Stated error of the int16 GEMV path (two int16 terms per element, ~2^-24 of the block max):
# max|y - y_exact| / max|y_exact| per GEMV / MoE layer, the fp32 path's bound (measured 2e-7..7e-7).
ACT16_REL_ERR = 1e-5
# Stated error of the three-digit GEMV path (xi = h 2^16 + m 2^8 + l, |xi| <= 2^22 per block, so
# <= 2^-22 of the block max per element): the same per-GEMV / per-MoE-layer bound as INT16.
INT8X3_REL_ERR = 1e-5


class Activations(enum.IntEnum):
    """How a kernel call multiplies its activations with the quantized weights.

    A per-call argument (not a process setting), so two models in one process can differ.

    FP32: fp32 activations, ~1e-7 relative error per GEMV (the default).
    INT16: on the GEMV path (few tokens per expert or dense call) each activation is split per
        32-element block into two int16 terms (x = d (hi + lo 2^-16), d = max|x|/32767) and
        multiplied in exact integer arithmetic (vpmaddwd / vpdpwssd), within ACT16_REL_ERR like
        fp32; the tile path (many tokens) stays fp32. Opt-in: it measured no faster than fp32 on
        Zen 4 (one term alone was 1.45x faster but 2-3e-4 off on the test models' logits).
    INT8X3: on the MXFP4 GEMV path (few tokens per expert or dense call) each activation is
        scaled per 32-element block by a power of two and split into three signed-byte digits
        (x = 2^kx (h 2^16 + m 2^8 + l), |.| <= 2^22: 22-23 bits of the block max, like fp32);
        each digit is one vpdpbusd against the unsigned weight bytes, the digits are combined in
        exact int32, then one FMA by the block scales: within INT8X3_REL_ERR. Needs AVX-512
        VNNI + VBMI (`digits_active()`); Q8_0 weights, the tile path and other ISAs compute fp32.
    INT8: fast math. Activations quantized per 32-element block to int8 (scale max|x|/127, round
        to nearest) and multiplied in integer arithmetic, on the GEMV and the tile path: cold T=1
        MoE layer ~1.5-1.7x faster on AVX2 (bench/kernels.py; the memory-bound Q8_0 head
        ~1.1-1.3x), int8 GEMM on the tile path (MXFP4 ~1.4x, Q8_0 ~1.1x), at ~5e-3 relative error
        per GEMV (~1e-2 through a MoE layer). NaN/inf in an input block gives NaN outputs.
    The torch fallback (no library) always computes in fp32.
    """

    FP32 = 0
    INT16 = 1
    INT8 = 2
    INT8X3 = 3

    @classmethod
    def for_fast_math(cls, fast_math: bool) -> "Activations":
        """INT8 when fast math is asked for, else the exact default."""
        return cls.INT8 if fast_math else cls.FP32


def act_code(act: Activations) -> int:
    """The mode number the C entry points take (a ValueError for anything but an Activations)."""
    if not isinstance(act, Activations):
        raise ValueError(f"act must be a kernels.Activations, got {act!r}")
    return int(act)
