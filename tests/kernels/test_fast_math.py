"""Opt-in fast mode (act=kernels.Activations.INT8): int8 activations on the GEMV and tile paths.

Measured against the float64 ground truth (max|y - ref| / max|ref|): dense GEMV ~5e-3 (K=2880,
20 seeds: median 5.0e-3, max 9.6e-3, both formats); MoE layer (two quantized activations, SwiGLU
in between, H=128) median 1.2e-2, max 1.3e-2. The fp32 default is ~1e-7, so the lower bound
FAST_MIN shows the int8 path really ran.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hybridmoe.kernels as K
from hybridmoe.gguf.constants import GGMLType
from hybridmoe.kernels._lib import LIB

from kernel_helpers import dequant64, isa_params, make_experts, moe_reference64, quantized, rel_err, routing

H, I = 128, 96
LINEAR_FAST_TOL = 2e-2
MOE_FAST_TOL = 3e-2
FAST_MIN = 1e-4  # fp32 mode is ~1e-7: above this, the int8 path is what ran

needs_lib = pytest.mark.skipif(not K.available(), reason="compiled kernels not built")


@pytest.fixture
def fast() -> K.Activations:
    return K.Activations.INT8


def test_fast_math_is_a_per_call_mode():
    assert K.Activations.for_fast_math(True) is K.Activations.INT8
    assert K.Activations.for_fast_math(False) is K.Activations.FP32


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("t", [GGMLType.MXFP4, GGMLType.Q8_0], ids=["mxfp4", "q8_0"])
@pytest.mark.parametrize("T,k_in", [(1, 2880), (3, 160), (8, 96), (1, 32)])
def test_fast_linear_vs_float64(isa, t, T, k_in, use_isa, fast):
    use_isa(isa)
    rng = np.random.default_rng()
    w = quantized(rng, 40, k_in, t)
    x = torch.from_numpy(rng.standard_normal((T, k_in), dtype=np.float32))
    ref = x.double() @ dequant64(w, t).T
    err = rel_err(K._linear(x, w, None, t, fast), ref)
    assert FAST_MIN < err < LINEAR_FAST_TOL


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("T,k", [(1, 4), (3, 4), (5, 8)])
def test_fast_moe_vs_float64(isa, T, k, use_isa, fast):
    use_isa(isa)
    rng = np.random.default_rng()
    ex = make_experts(rng, 16, H, I)
    x = torch.from_numpy(rng.standard_normal((T, H), dtype=np.float32))
    ids, w = routing(rng, T, k, 16)
    err = rel_err(K.moe_forward(x, ids, w, ex, act=fast), moe_reference64(x, ids, w, ex))
    assert FAST_MIN < err < MOE_FAST_TOL


@needs_lib
def test_fast_moe_q8_0_and_mixed_tile_path(use_isa, fast):
    """Q8_0 experts; one expert over the GEMV limit takes the tile path (int8 GEMM) in the same call."""
    rng = np.random.default_rng()
    K.set_gemv_max_tokens(3, fast_math=True)
    ex = make_experts(rng, 4, H, I, t=GGMLType.Q8_0)
    T = 6
    ids = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 1], [0, 2], [0, 3]], dtype=torch.int32)
    w = torch.rand(T, 2)
    x = torch.randn(T, H)
    err = rel_err(K.moe_forward(x, ids, w, ex, act=fast), moe_reference64(x, ids, w, ex))
    assert FAST_MIN < err < MOE_FAST_TOL


@pytest.mark.parametrize("t", [GGMLType.MXFP4, GGMLType.Q8_0], ids=["mxfp4", "q8_0"])
@needs_lib
def test_fast_scalar_and_simd_agree_exactly(t, use_isa, fast):
    """Same integer dot products and the same float operation order: bit-identical results."""
    rng = np.random.default_rng()
    simd = [p.values[0] for p in isa_params() if not p.marks and p.values[0] != "scalar"]
    if not simd:
        pytest.skip("no SIMD variant on this CPU")
    w = quantized(rng, 50, 224, t)  # 7 blocks: odd tail
    ex = make_experts(rng, 8, H, I, t=t)
    x = torch.from_numpy(rng.standard_normal((8, 224), dtype=np.float32))
    xm = torch.from_numpy(rng.standard_normal((5, H), dtype=np.float32))
    ids, wts = routing(rng, 5, 4, 8)
    out = {}
    for isa in ["scalar", *simd]:
        use_isa(isa)
        out[isa] = ([K._linear(x[:n], w, None, t, fast) for n in range(1, 9)],
                    K.moe_forward(xm, ids, wts, ex, act=fast))
    for isa in simd:
        assert all(torch.equal(a, b) for a, b in zip(out["scalar"][0], out[isa][0])), isa
        assert torch.equal(out["scalar"][1], out[isa][1]), isa


@pytest.mark.parametrize("t", [GGMLType.MXFP4, GGMLType.Q8_0], ids=["mxfp4", "q8_0"])
@needs_lib
def test_fast_k_chunked_gemv_agrees_exactly_and_with_float64(t, use_isa, fast):
    """K = 2880, 53 rows, 5..16 tokens: the AVX2 int8 GEMV walks K in chunks over 24-row groups
    (accumulators carried across chunks in the same order, so still bit-identical to scalar)."""
    rng = np.random.default_rng()
    simd = [p.values[0] for p in isa_params() if not p.marks and p.values[0] != "scalar"]
    if not simd:
        pytest.skip("no SIMD variant on this CPU")
    w = quantized(rng, 53, 2880, t)
    x = torch.from_numpy(rng.standard_normal((16, 2880), dtype=np.float32))
    ref = x.double() @ dequant64(w, t).T
    out = {}
    for isa in ["scalar", *simd]:
        use_isa(isa)
        K.set_gemv_max_tokens(16, fast_math=True)
        out[isa] = [K._linear(x[:n], w, None, t, fast) for n in (5, 8, 11, 16)]
    for isa in simd:
        assert all(torch.equal(a, b) for a, b in zip(out["scalar"], out[isa])), isa
    assert FAST_MIN < rel_err(out["scalar"][-1], ref) < LINEAR_FAST_TOL


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_fast_nan_and_inf_propagate(isa, bad, use_isa, fast):
    use_isa(isa)
    rng = np.random.default_rng()
    w = quantized(rng, 24, 64, GGMLType.MXFP4)
    x = torch.from_numpy(rng.standard_normal((2, 64), dtype=np.float32))
    x[0, 5] = bad
    y = K.linear_mxfp4(x, w, act=fast)
    assert torch.isnan(y[0]).all()
    assert torch.isfinite(y[1]).all()
    ex = make_experts(rng, 4, H, I)
    xm = torch.randn(2, H)
    xm[1, 7] = bad
    ids, wts = routing(rng, 2, 2, 4)
    ym = K.moe_forward(xm, ids, wts, ex, act=fast)
    assert torch.isnan(ym[1]).all() and torch.isfinite(ym[0]).all()


@pytest.mark.parametrize("isa", isa_params())
def test_default_mode_unchanged_after_fast_calls(isa, use_isa):
    """Fast mode off (default): outputs bit-identical before and after fast-mode calls, and fp32
    accurate (the int8 path leaves no state behind)."""
    use_isa(isa)
    rng = np.random.default_rng()
    w = quantized(rng, 40, 128, GGMLType.Q8_0)
    ex = make_experts(rng, 8, H, I)
    x = torch.from_numpy(rng.standard_normal((3, H), dtype=np.float32))
    ids, wts = routing(rng, 3, 4, 8)

    def run(act: K.Activations = K.Activations.FP32):
        return K.linear_q8_0(x, w, act=act), K.moe_forward(x, ids, wts, ex, act=act)

    before = run()
    fast_out = run(K.Activations.INT8)
    after = run()
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert not any(torch.equal(a, b) for a, b in zip(before, fast_out))
    assert rel_err(after[1], moe_reference64(x, ids, wts, ex)) < 1e-5


@pytest.mark.parametrize("t", [GGMLType.MXFP4, GGMLType.Q8_0], ids=["mxfp4", "q8_0"])
@needs_lib
def test_fast_mode_tile_path_is_int8(t, use_isa, fast):
    """Above the GEMV limit, fast mode takes the int8 GEMM for both formats (fast-mode error,
    so not the fp32 tile, which is ~1e-7); the default mode stays exact on the same inputs."""
    rng = np.random.default_rng()
    K.set_gemv_max_tokens(2, fast_math=True)
    x = torch.from_numpy(rng.standard_normal((5, 128), dtype=np.float32))
    w = quantized(rng, 30, 128, t)
    ref = x.double() @ dequant64(w, t).T
    lin = K.linear_mxfp4 if t == GGMLType.MXFP4 else K.linear_q8_0
    assert FAST_MIN < rel_err(lin(x, w, act=fast), ref) < LINEAR_FAST_TOL
    assert rel_err(lin(x, w), ref) < 1e-5


@needs_lib
def test_fast_mode_has_its_own_crossover(use_isa, fast):
    """Fast mode takes the int8 tile GEMM from 3 tokens by default (same bits as forcing it), the
    int8 GEMV up to 2; the fp32 crossover is separate (setting one leaves the other)."""
    rng = np.random.default_rng()
    w = quantized(rng, 70, 256, GGMLType.MXFP4)
    x = torch.from_numpy(rng.standard_normal((3, 256), dtype=np.float32))
    default = [K.linear_mxfp4(x[:n], w, act=fast) for n in (2, 3)]
    fp32_default = K.linear_mxfp4(x, w)
    K.set_gemv_max_tokens(0, fast_math=True)
    tile = K.linear_mxfp4(x[:3], w, act=fast)
    assert torch.equal(K.linear_mxfp4(x, w), fp32_default)  # the fp32 path did not move
    K.set_gemv_max_tokens(16, fast_math=True)
    gemv = K.linear_mxfp4(x[:2], w, act=fast)
    assert torch.equal(default[0], gemv) and torch.equal(default[1], tile)


@pytest.mark.parametrize("t", [GGMLType.MXFP4, GGMLType.Q8_0], ids=["mxfp4", "q8_0"])
@pytest.mark.parametrize("k_in", [224, 2880])
@pytest.mark.parametrize("rows", [53, 150])
@needs_lib
def test_fast_int8_gemm_agrees_exactly_and_with_float64(rows, k_in, t, use_isa, fast):
    """The int8 tile GEMM (fast mode, tokens over the GEMV limit): 53 rows (one unit: AVX2 6 full
    8-row panels and a 5-row edge; VNNI three 16-row panels and the edge) or 150 (two 64-row
    units, VNNI's four-panel kernel, then a 22-row unit), 7 blocks (odd: the last pair's partner
    missing) or 90, token counts that leave every remainder of the token groups (3 and 4);
    scalar and SIMD bit-identical, and float64 close. Q8_0 rows include -127/127 quants (the
    |w| * sign(x, w) products at their int16 limit; VNNI's quant + 128 offset at 255 and 1)."""
    rng = np.random.default_rng()
    simd = [p.values[0] for p in isa_params() if not p.marks and p.values[0] != "scalar"]
    if not simd:
        pytest.skip("no SIMD variant on this CPU")
    w = quantized(rng, rows, k_in, t)
    if t == GGMLType.Q8_0:
        blocks = w.reshape(rows, -1, 34)
        blocks[0, :, 2:] = np.uint8(127)  # row 0: every quant +127, row 1: -127 (0x81), row 2: 0
        blocks[1, :, 2:] = np.uint8(0x81)
        blocks[2, :, 2:] = 0
    x = torch.from_numpy(rng.standard_normal((17, k_in), dtype=np.float32))
    x[3], x[4] = 5.0, -5.0  # all quants +127 / -127: with rows 0 and 1, pair sums of +-32258
    ref = x.double() @ dequant64(w, t).T
    lin = K.linear_mxfp4 if t == GGMLType.MXFP4 else K.linear_q8_0
    out = {}
    for isa in ["scalar", *simd]:
        use_isa(isa)
        K.set_gemv_max_tokens(0, fast_math=True)
        out[isa] = [lin(x[:n], w, act=fast) for n in (1, 2, 7, 17)]
    K.set_num_threads(2)  # rows quantized over the pool, row chunks on two threads: same bits
    out["2 threads"] = [lin(x[:n], w, act=fast) for n in (1, 2, 7, 17)]
    for isa in [*simd, "2 threads"]:
        assert all(torch.equal(a, b) for a, b in zip(out["scalar"], out[isa])), isa
    assert rel_err(out["scalar"][-1], ref) < LINEAR_FAST_TOL
    rand_tok = [i for i in range(17) if i not in (3, 4)]  # the crafted rows' huge outputs set the scale
    assert FAST_MIN < rel_err(out["scalar"][-1][rand_tok, 3:], ref[rand_tok, 3:]) < LINEAR_FAST_TOL


@needs_lib
def test_fast_moe_int8_tile_slots_exact_across_isas(use_isa, fast):
    """A fast-mode MoE whose experts all take the tile path (limit 0): gate/up and down through
    the int8 GEMM; scalar and SIMD bit-identical; float64 within the fast tolerance."""
    rng = np.random.default_rng()
    simd = [p.values[0] for p in isa_params() if not p.marks and p.values[0] != "scalar"]
    if not simd:
        pytest.skip("no SIMD variant on this CPU")
    ex = make_experts(rng, 8, H, I)
    x = torch.from_numpy(rng.standard_normal((11, H), dtype=np.float32))
    ids, wts = routing(rng, 11, 4, 8)
    out = {}
    for isa in ["scalar", *simd]:
        use_isa(isa)
        K.set_gemv_max_tokens(0, fast_math=True)
        out[isa] = K.moe_forward(x, ids, wts, ex, act=fast)
    for isa in simd:
        assert torch.equal(out["scalar"], out[isa]), isa
    assert FAST_MIN < rel_err(out["scalar"], moe_reference64(x, ids, wts, ex)) < MOE_FAST_TOL


def _quantize_q8_numpy(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Independent reference of the fast-mode activation quantizer, per 32-block: d = max|x|/127,
    q = round-half-even(x * (127/max|x|)) (zeros when max|x| < 1e-30; zeros and d = NaN when the
    block holds NaN/inf). Returns q [nb, 32], d [nb], the 4 lane sums [nb, 4] and block sums [nb]
    (12 x the sums of q the int8 kernels subtract)."""
    xb = x.reshape(-1, 32).astype(np.float32)
    a = np.abs(xb)
    finite = np.isfinite(xb).all(axis=1)
    amax = np.where(finite, np.where(np.isfinite(a), a, 0).max(axis=1), 0).astype(np.float32)
    d = np.where(finite, amax / np.float32(127), np.nan).astype(np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):  # masked by the where()s
        inv = np.where(amax >= np.float32(1e-30), np.float32(127) / amax, 0).astype(np.float32)
        v = np.where(finite[:, None], xb * inv[:, None], 0).astype(np.float32)
    q = np.clip(np.rint(v), -127, 127).astype(np.int8)
    lanes = 12 * (q.reshape(-1, 2, 4, 4).astype(np.int32).sum(axis=(1, 3)))  # lane l: 4l.. and 16+4l..
    return q, d, lanes, lanes.sum(axis=1)


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("k_in", [32, 96, 2880])
@needs_lib
def test_quantize_q8_matches_numpy_bit_for_bit(isa, k_in, use_isa):
    """Every variant's activation quantizer against the numpy reference on fresh random rows plus
    crafted blocks: exact .5 ties (round half to even), +-127 extremes, all zeros, a denormal-tiny
    block, NaN and inf blocks; then the pair layout (q bytes, scales, lane sums, block sums)."""
    use_isa(isa)
    rng = np.random.default_rng()
    nb = k_in // 32
    x = (rng.standard_normal(k_in) * rng.choice([1e-3, 1.0, 50.0], size=k_in)).astype(np.float32)
    crafted = [np.concatenate([[127.0], np.arange(-30.5, 0.5, 1.0)]).astype(np.float32),  # id = 1: ties
               np.arange(-15.5, 16.5, 1.0, dtype=np.float32) * (127 / 16),
               np.zeros(32, np.float32), np.full(32, 1e-38, np.float32),
               np.where(np.arange(32) == 5, np.nan, 1.0).astype(np.float32),
               np.where(np.arange(32) == 9, -np.inf, 2.0).astype(np.float32)]
    for i, blk in enumerate(crafted[:nb]):
        x[i * 32:(i + 1) * 32] = blk
    q_buf = np.full(k_in // 64 * 96 + 96, 0x55, np.uint8)
    d_buf = np.full((nb + 1) // 2 * 8 + nb, 7.0, np.float32)
    n = LIB.hm_quantize_q8(x.ctypes.data, k_in, q_buf.ctypes.data, d_buf.ctypes.data)
    pairs = (nb + 1) // 2
    assert n == pairs * 96
    q, d, lanes, sums = _quantize_q8_numpy(x)
    for b in range(nb):
        base = (b // 2) * 96 + (b % 2) * 16
        got = np.concatenate([q_buf[base:base + 16], q_buf[base + 32:base + 48]]).view(np.int8)
        assert np.array_equal(got, q[b]), (b, got, q[b])
        got_d = d_buf[(b // 2) * 8 + (b % 2) * 4:(b // 2) * 8 + (b % 2) * 4 + 4]
        assert np.array_equal(got_d, np.full(4, d[b]), equal_nan=True), (b, got_d, d[b])
        assert np.array_equal(q_buf[(b // 2) * 96 + 64 + (b % 2) * 16:][:16].view(np.int32), lanes[b]), b
    assert np.array_equal(d_buf[pairs * 8:].view(np.int32), sums)
    if nb % 2:  # the odd last block's missing partner is zeros
        assert not q_buf[(nb // 2) * 96 + 16:(nb // 2) * 96 + 32].any()
        assert not d_buf[(nb // 2) * 8 + 4:(nb // 2) * 8 + 8].any()
