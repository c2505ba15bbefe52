"""The int16-activation GEMV path (two int16 terms per element): quantizer bit-exact on every ISA
against an independent numpy reference, the GEMV against float64 on the quantized inputs, the
stated error (kernels.ACT16_REL_ERR) against float64 on the real inputs, NaN never passing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hybridmoe.kernels as K
from hybridmoe.gguf.constants import GGMLType
from hybridmoe.kernels._lib import LIB

from kernel_helpers import dequant64, isa_params, make_experts, moe_reference64, quantized, rel_err, routing

TYPES = [pytest.param(GGMLType.MXFP4, id="mxfp4"), pytest.param(GGMLType.Q8_0, id="q8_0")]
# Products are exact integers; only the fp32 sums round.
GEMV_ON_QUANTIZED_TOL = 2e-6

INT16 = K.Activations.INT16


pytestmark = pytest.mark.skipif(not K.available(), reason="compiled kernels not built (torch fallback only)")


def q16_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Independent twin of quantize_x_q16 in natural order: hi, lo [nb, 32] int16, d [nb] float32."""
    xb = x.astype(np.float32).reshape(-1, 32)
    a = np.abs(xb)
    finite = np.isfinite(xb).all(1)
    amax = np.where(finite, np.where(np.isfinite(a), a, 0).max(1), 0).astype(np.float32)
    d = np.where(finite, amax / np.float32(32767), np.float32(np.nan)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv = np.where(amax >= np.float32(1e-30), np.float32(32767) / amax, np.float32(0)).astype(np.float32)
        v = (np.where(finite[:, None], xb, 0) * inv[:, None]).astype(np.float32)
    h = np.clip(np.rint(v), -32767, 32767).astype(np.float32)  # rint: half to even
    lo = np.clip(np.rint((v - h) * np.float32(65536)), -32767, 32767)
    return h.astype(np.int16), lo.astype(np.int16), d


def layout_positions(nb: int) -> np.ndarray:
    """[nb, 32] index into the pair layout of common.h (runs of 8 per block, blocks interleaved)."""
    b = np.arange(nb)[:, None]
    j = np.arange(32)[None, :]
    return (b // 2) * 128 + (j // 8) * 16 + (b % 2) * 8 + j % 8  # the hi term; lo at +64


def kernel_q16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    K_ = x.size
    nb, pairs = K_ // 32, (K_ // 32 + 1) // 2
    q = np.full(pairs * 128, 12345, dtype=np.int16)  # the kernel must write every element
    d = np.full(pairs * 8, 7.0, dtype=np.float32)
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = LIB.hm_quantize_q16(x.ctypes.data, K_, q.ctypes.data, d.ctypes.data)
    assert n == pairs * 128
    pos = layout_positions(nb + 1)  # row nb: the odd last block's missing partner
    d4 = d.reshape(pairs * 2, 4)
    assert all(np.array_equal(d4[:, i].view(np.uint32), d4[:, 0].view(np.uint32)) for i in range(4))
    scales = d4[:nb, 0]
    if nb % 2:
        assert (q[pos[nb]] == 0).all() and (q[pos[nb] + 64] == 0).all() and (d4[nb] == 0).all()
    pos = pos[:nb]
    return q[pos], q[pos + 64], scales


def tricky_row(rng: np.random.Generator, nb: int) -> np.ndarray:
    x = rng.standard_normal((nb, 32)).astype(np.float32) * np.exp(rng.uniform(-8, 8, (nb, 1))).astype(np.float32)
    x[0, :] = 0.0                                  # all zero
    x[1, :] = np.float32(1e-35)                    # below the tiny threshold: zeros
    x[2, 0], x[2, 1] = 32767.0, -16383.5           # exact max, a tie (rounds to even)
    x[2, 2:] = np.arange(30) - 14.5                # more ties
    x[3, 5] = np.nan
    x[4, 7] = -np.inf
    x[5, :] = -3.0e38                              # huge, finite
    return x.reshape(-1)


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("nb", [6, 7, 90])
def test_quantizer_bit_exact(isa, nb, use_isa):
    use_isa(isa)
    x = tricky_row(np.random.default_rng(), nb)
    hi, lo, d = kernel_q16(x)
    rhi, rlo, rd = q16_reference(x)
    assert np.array_equal(hi, rhi) and np.array_equal(lo, rlo)
    assert np.array_equal(d.view(np.uint32), rd.view(np.uint32))
    # per element |x - d (hi + lo 2^-16)| <= 2^-23 max|x| of the block (fp32 rounding of x / d)
    xb = x.reshape(nb, 32).astype(np.float64)
    ok = np.isfinite(xb).all(1)
    rep = (hi.astype(np.float64) + lo.astype(np.float64) / 65536) * d[:, None].astype(np.float64)
    err = np.abs(xb - rep)[ok]
    assert (err <= np.abs(xb[ok]).max(1, keepdims=True) * 2.0**-23 + 1e-30).all()  # tiny blocks: zeros


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("T,Kd", [(1, 2880), (2, 2880), (3, 352), (4, 2880), (7, 2880), (8, 320), (13, 2880),
                                  (16, 2880), (1, 352), (5, 96)])
def test_gemv_on_quantized_inputs(isa, t, T, Kd, use_isa):
    """The int16 GEMV equals float64 on the quantized activations (the exact integer products),
    up to the fp32 sum: rows with K chunks, row groups, odd block counts, 1..16 tokens."""
    use_isa(isa)
    K.set_gemv_max_tokens(16, ggml_type=t)  # the int16 GEMV itself, not the fp32 tile path (avx2 MXFP4: T > 14)
    rng = np.random.default_rng()
    N = 53
    w = quantized(rng, N, Kd, t)
    x = rng.standard_normal((T, Kd)).astype(np.float32) * np.exp(rng.uniform(-3, 3, (T, 1))).astype(np.float32)
    xq = np.empty_like(x, dtype=np.float64)
    for i in range(T):
        hi, lo, d = q16_reference(x[i])
        xq[i] = ((hi.astype(np.float64) + lo.astype(np.float64) / 65536) * d[:, None]).reshape(-1)
    ref = torch.from_numpy(xq) @ dequant64(w, t).T
    y = K._linear(torch.from_numpy(x), w, None, t, INT16)
    assert torch.isfinite(y).all()
    assert rel_err(y, ref) < GEMV_ON_QUANTIZED_TOL
    # and the stated error against the unquantized inputs
    assert rel_err(y, torch.from_numpy(x).double() @ dequant64(w, t).T) < K.ACT16_REL_ERR


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("T,k", [(1, 4), (4, 4), (9, 2)])
def test_moe_stated_error(isa, T, k, use_isa):
    use_isa(isa)
    rng = np.random.default_rng()
    E, H, I = 8, 2880, 320
    ex = make_experts(rng, E, H, I)
    x = torch.randn(T, H)
    ids, w = routing(rng, T, k, E)
    assert rel_err(K.moe_forward(x, ids, w, ex, act=INT16), moe_reference64(x, ids, w, ex)) < K.ACT16_REL_ERR


@pytest.mark.parametrize("isa", isa_params())
def test_nan_and_inf_never_pass(isa, use_isa):
    use_isa(isa)
    rng = np.random.default_rng()
    w = quantized(rng, 30, 320, GGMLType.MXFP4)
    x = torch.randn(3, 320)
    x[1, 40] = float("nan")
    x[2, 300] = float("inf")
    y = K.linear_mxfp4(x, w, act=INT16)
    assert torch.isfinite(y[0]).all()
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all()


def test_mode_is_per_call():
    """int16 and fp32 calls interleave without leaving state behind; a bad mode is named."""
    with pytest.raises(ValueError, match="kernels.Activations"):
        K.linear_q8_0(torch.randn(1, 320), quantized(np.random.default_rng(1), 4, 320, GGMLType.Q8_0),
                      act=1)  # type: ignore[arg-type]
    rng = np.random.default_rng(3)
    w = quantized(rng, 40, 320, GGMLType.Q8_0)
    x = torch.randn(2, 320)
    y32 = K.linear_q8_0(x, w)
    y16 = K.linear_q8_0(x, w, act=INT16)
    assert not torch.equal(y16, y32) and rel_err(y16, y32) < K.ACT16_REL_ERR
    assert torch.equal(K.linear_q8_0(x, w), y32)
    assert torch.equal(K.linear_q8_0(x, w, act=INT16), y16)
