"""The three-digit activation mode (Activations.INT8X3): quantizer bit-exact on every ISA against an
independent numpy twin, the GEMV against float64 on the quantized inputs, the stated error
(kernels.INT8X3_REL_ERR) against float64 on the real inputs, SIMD bit-identical to the scalar
reference (also on the exact per-row fallback for weight exponents outside the fast range), NaN
never passing, and ISAs / formats without the digits GEMV computing exactly the fp32 results."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hybridmoe.kernels as K
from hybridmoe.gguf.constants import GGMLType
from hybridmoe.kernels._lib import LIB

from kernel_helpers import dequant64, isa_params, isa_supported, make_experts, moe_reference64, quantized, rel_err, routing

D3 = K.Activations.INT8X3
# Products are exact integers; the int32 -> fp32 conversion per lane and the fp32 sums round.
GEMV_ON_QUANTIZED_TOL = 2e-6

pytestmark = pytest.mark.skipif(not K.available(), reason="compiled kernels not built (torch fallback only)")


def digits_isas():
    """ISAs whose INT8X3 GEMV is the digits kernel: scalar always, avx512 where VBMI is present."""
    return [p for p in isa_params() if p.values[0] != "avx2"]


def use_digits_isa(isa: str, use_isa) -> None:
    use_isa(isa)
    if not K.digits_active():
        pytest.skip(f"the {isa} set has no three-digit GEMV on this CPU (INT8X3 computes fp32)")


def elem_offsets(nb: int) -> np.ndarray:
    """[nb, 32] byte offset of the top digit of element j of block b (common.h d3x_elem)."""
    b = np.arange(nb)[:, None]
    j = np.arange(32)[None, :]
    return 64 + (b // 4) * 512 + ((b // 2) % 2) * 192 + (b % 2) * 16 + np.where(j < 16, j, j + 16)


def d3_reference(x: np.ndarray) -> np.ndarray:
    """Independent twin of quantize_x_d3: the whole byte image of one row."""
    nb = x.size // 32
    nq = (nb + 3) // 4
    out = np.zeros(64 + nq * 512, dtype=np.uint8)
    xb = x.astype(np.float32).reshape(nb, 32)
    finite = np.isfinite(xb).all(1)
    amax = np.where(finite, np.abs(np.where(np.isfinite(xb), xb, 0)).max(1), 0).astype(np.float32)
    live = finite & (amax >= np.float32(1e-30))
    kx = (amax.view(np.uint32) >> 23).astype(np.int64) - 148
    with np.errstate(over="ignore", invalid="ignore"):
        xi = np.where(live[:, None], np.rint(np.where(live[:, None], xb, 0).astype(np.float64)
                                             * np.exp2(-kx[:, None].astype(np.float64))), 0).astype(np.int64)
    low = (xi + 128) % 256 - 128
    r = (xi - low) // 256
    mid = (r + 128) % 256 - 128
    top = (r - mid) // 256
    pos = elem_offsets(nb)
    for d, v in enumerate((top, mid, low)):
        out[pos + 64 * d] = v.astype(np.int8).view(np.uint8)
    kx_min, kx_max = (int(kx[live].min()), int(kx[live].max())) if live.any() else (0, 0)
    corr = np.zeros((4 * nq, 4), dtype=np.int32)
    kxm1 = np.full((4 * nq, 4), kx_min - 1, dtype=np.int32)
    for i in range(4):
        corr[:nb, i] = 12 * (xi[:, 4 * i:4 * i + 4].sum(1) + xi[:, 16 + 4 * i:20 + 4 * i].sum(1))
    kxm1[:nb][live] = (kx[live] - 1)[:, None]
    lanes = out[64:].reshape(nq, 512)
    lanes[:, 384:448] = corr.reshape(nq, 16).view(np.uint8)
    lanes[:, 448:512] = kxm1.reshape(nq, 16).view(np.uint8)
    head = np.array([2 - kx_min, 226 - kx_max], dtype=np.int32).view(np.uint8)
    out[:8] = head
    out[8:12] = np.array([0.0 if finite.all() else np.nan], dtype=np.float32).view(np.uint8)
    return out


def dequantized_d3(x: np.ndarray) -> np.ndarray:
    """float64 value of the quantized row: xi * 2^kx per block (zeros for zero / non-finite blocks)."""
    q = d3_reference(x)
    nb = x.size // 32
    pos = elem_offsets(nb)
    digits = [q[pos + 64 * d].view(np.int8).astype(np.int64) for d in range(3)]
    xi = digits[0] * 65536 + digits[1] * 256 + digits[2]
    kxm1 = q[64:].reshape(-1, 512)[:, 448:512].copy().view(np.int32).reshape(-1, 4)[:nb, 0]
    return (xi * np.exp2(kxm1[:, None].astype(np.float64) + 1)).reshape(-1)


def kernel_d3(x: np.ndarray) -> np.ndarray:
    nq = (x.size // 32 + 3) // 4
    q = np.full(64 + nq * 512, 0xA5, dtype=np.uint8)  # the kernel must write every byte
    x = np.ascontiguousarray(x, dtype=np.float32)
    assert LIB.hm_quantize_d3(x.ctypes.data, x.size, q.ctypes.data) == q.size
    return q


def tricky_row(rng: np.random.Generator, nb: int) -> np.ndarray:
    x = rng.standard_normal((nb, 32)).astype(np.float32) * np.exp(rng.uniform(-8, 8, (nb, 1))).astype(np.float32)
    x[0, :] = 0.0                                  # all zero
    x[1, :] = np.float32(1e-35)                    # below the tiny threshold: zeros
    x[2, 0], x[2, 1] = 4.0, -2.0 ** -20            # exact power of two max; a tie after scaling
    x[2, 2:] = (np.arange(30) - 14.5) * 2.0 ** -19  # more ties (half-integers after scaling: to even)
    x[3, 5] = -3.0e38                              # huge, finite
    x[4, :] = np.float32(1e-30) * (1 + np.arange(32))  # tiny but kept; some denormal-range digits
    x[4, 3] = 1e-44                                # a denormal element
    return x.reshape(-1)


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("nb", [5, 6, 7, 8, 90])
def test_quantizer_bit_exact(isa, nb, use_isa):
    use_isa(isa)
    x = tricky_row(np.random.default_rng(), nb)
    assert np.array_equal(kernel_d3(x), d3_reference(x))
    # per element |x - xi 2^kx| <= 2^-22 max|x| of the block (round to nearest of exact scaling)
    xb = x.reshape(nb, 32).astype(np.float64)
    err = np.abs(xb - dequantized_d3(x).reshape(nb, 32))
    keep = np.abs(xb).max(1) >= 1e-30
    assert (err[keep] <= np.abs(xb[keep]).max(1, keepdims=True) * 2.0 ** -22).all()


@pytest.mark.parametrize("isa", isa_params())
def test_quantizer_nan_and_inf_poison(isa, use_isa):
    use_isa(isa)
    for bad in (np.nan, np.inf, -np.inf):
        x = np.random.default_rng().standard_normal(320).astype(np.float32)
        x[77] = bad
        q = kernel_d3(x)
        assert np.array_equal(q, d3_reference(x))
        assert np.isnan(q[8:12].view(np.float32)[0])


@pytest.mark.parametrize("isa", digits_isas())
@pytest.mark.parametrize("T,Kd", [(1, 2880), (2, 2880), (3, 352), (4, 2880), (7, 2880), (8, 320), (13, 2880),
                                  (16, 2880), (1, 352), (5, 96), (1, 32), (2, 64)])
def test_gemv_on_quantized_inputs(isa, T, Kd, use_isa):
    """The digits GEMV equals float64 on the quantized activations (exact integer products) up to
    the fp32 rounding: K chunks, row groups, partial last quads (K/32 % 4 != 0), 1..16 tokens."""
    use_digits_isa(isa, use_isa)
    rng = np.random.default_rng()
    t = GGMLType.MXFP4
    K.set_gemv_max_tokens(16, ggml_type=t)  # the digits GEMV itself, not the fp32 tile path
    w = quantized(rng, 53, Kd, t)
    x = rng.standard_normal((T, Kd)).astype(np.float32) * np.exp(rng.uniform(-3, 3, (T, 1))).astype(np.float32)
    xq = np.stack([dequantized_d3(x[i]) for i in range(T)])
    W = dequant64(w, t)
    y = K._linear(torch.from_numpy(x), w, None, t, D3)
    assert torch.isfinite(y).all()
    assert rel_err(y, torch.from_numpy(xq) @ W.T) < GEMV_ON_QUANTIZED_TOL
    assert rel_err(y, torch.from_numpy(x).double() @ W.T) < K.INT8X3_REL_ERR


@pytest.mark.skipif(not isa_supported("avx512"), reason="this CPU lacks the instructions of the avx512 kernels")
@pytest.mark.parametrize("T,Kd", [(1, 2880), (3, 2880), (8, 352), (2, 160)])
def test_simd_bit_identical_to_scalar(T, Kd, use_isa):
    use_digits_isa("avx512", use_isa)
    rng = np.random.default_rng()
    w = quantized(rng, 61, Kd, GGMLType.MXFP4)
    x = torch.randn(T, Kd) * 5
    y = K.linear_mxfp4(x, w, act=D3)
    use_isa("scalar")
    assert torch.equal(y, K.linear_mxfp4(x, w, act=D3))


def extreme_weights(rng: np.random.Generator, rows: int, kd: int, exps: list[int]) -> np.ndarray:
    """MXFP4 rows with random nibbles and each row's block exponents drawn from `exps`."""
    w = rng.integers(0, 256, size=(rows, kd // 32, 17), dtype=np.uint8)
    w[:, :, 0] = rng.choice(np.array(exps, dtype=np.uint8), size=(rows, kd // 32))
    return w.reshape(rows, -1)


@pytest.mark.parametrize("isa", digits_isas())
def test_exponents_outside_the_fast_range(isa, use_isa):
    """Weight exponents 0, 1 (subnormal scales) and near 255 leave [e_lo, e_hi]: those rows are
    redone exactly (ldexp), bit-identical to the scalar reference and close to float64."""
    use_digits_isa(isa, use_isa)
    rng = np.random.default_rng()
    kd = 352
    normal = extreme_weights(rng, 20, kd, [118, 120, 122, 127])
    low = extreme_weights(rng, 20, kd, [0, 1, 2, 3, 60])
    high = extreme_weights(rng, 20, kd, [200, 230, 250])
    w = np.concatenate([normal, low, normal[:5], high])
    x = torch.randn(3, kd)
    x[1] *= 1e-25  # small activations: the high exponents stay finite
    x[2, :64] *= 1e6
    y = K.linear_mxfp4(x, w, act=D3)
    W = dequant64(w, GGMLType.MXFP4)
    ref = x.double() @ W.T
    scale = x.double().abs() @ W.abs().T  # per output: sum |w x|
    fin = torch.isfinite(ref) & (scale < 1e37)
    assert torch.isfinite(y[fin]).all()
    assert ((y.double() - ref).abs()[fin] <= 1e-6 * scale[fin] + 2.0 ** -140).all()
    use_isa("scalar")
    ys = K.linear_mxfp4(x, w, act=D3)
    assert torch.equal(y.view(torch.int32), ys.view(torch.int32))


@pytest.mark.parametrize("isa", digits_isas())
@pytest.mark.parametrize("T,k", [(1, 4), (4, 4), (9, 2)])
def test_moe_stated_error(isa, T, k, use_isa):
    use_digits_isa(isa, use_isa)
    rng = np.random.default_rng()
    E, H, I = 8, 2880, 320
    ex = make_experts(rng, E, H, I)
    x = torch.randn(T, H)
    ids, w = routing(rng, T, k, E)
    assert rel_err(K.moe_forward(x, ids, w, ex, act=D3), moe_reference64(x, ids, w, ex)) < K.INT8X3_REL_ERR


@pytest.mark.parametrize("isa", digits_isas())
def test_nan_and_inf_never_pass(isa, use_isa):
    use_digits_isa(isa, use_isa)
    rng = np.random.default_rng()
    w = quantized(rng, 30, 320, GGMLType.MXFP4)
    x = torch.randn(3, 320)
    x[1, 40] = float("nan")
    x[2, 300] = float("inf")
    y = K.linear_mxfp4(x, w, act=D3)
    assert torch.isfinite(y[0]).all()
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all()


@pytest.mark.parametrize("isa", isa_params())
def test_without_the_digits_gemv_the_results_are_fp32(isa, use_isa):
    """Q8_0 weights, the tile path and ISAs without the digits GEMV compute exactly the fp32 path."""
    use_isa(isa)
    rng = np.random.default_rng(5)
    wq = quantized(rng, 40, 320, GGMLType.Q8_0)
    wm = quantized(rng, 40, 320, GGMLType.MXFP4)
    x = torch.randn(2, 320)
    assert torch.equal(K.linear_q8_0(x, wq, act=D3), K.linear_q8_0(x, wq))
    xt = torch.randn(40, 320)
    K.set_gemv_max_tokens(0)  # the tile path
    assert torch.equal(K.linear_mxfp4(xt, wm, act=D3), K.linear_mxfp4(xt, wm))
    if not K.digits_active():
        assert torch.equal(K.linear_mxfp4(x, wm, act=D3), K.linear_mxfp4(x, wm))


def test_mode_is_per_call():
    """INT8X3 and fp32 calls interleave without leaving state behind."""
    rng = np.random.default_rng(3)
    w = quantized(rng, 40, 320, GGMLType.MXFP4)
    x = torch.randn(2, 320)
    y32 = K.linear_mxfp4(x, w)
    y3 = K.linear_mxfp4(x, w, act=D3)
    assert rel_err(y3, y32) < K.INT8X3_REL_ERR
    assert K.digits_active() == (not torch.equal(y3, y32))
    assert torch.equal(K.linear_mxfp4(x, w), y32)
    assert torch.equal(K.linear_mxfp4(x, w, act=D3), y3)
