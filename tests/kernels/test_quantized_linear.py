"""Dequant (bit-exact) and quantized linear (stated tolerance) for every kernel variant."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hybridmoe.kernels as K
from hybridmoe.gguf.constants import GGMLType
from hybridmoe.kernels import reference

from kernel_helpers import default_tol, dequant64, isa_params, quantized, rel_err

TYPES = [pytest.param(GGMLType.MXFP4, id="mxfp4"), pytest.param(GGMLType.Q8_0, id="q8_0")]
# fp32 accumulation over K=320..2880 terms; observed 1e-7..2e-6, stated bound 1e-5.
LINEAR_TOL = 1e-5


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("t", TYPES)
def test_dequant_bit_exact(isa, t, use_isa):
    use_isa(isa)
    rng = np.random.default_rng()
    w = quantized(rng, 37, 320, t)
    ref = dequant64(w, t).numpy().astype(np.float32)
    mine = K.dequantize(w, t)
    assert mine.shape == (37, 320)
    assert np.array_equal(_bits(mine), _bits(ref)), f"worst row {np.argmax((mine != ref).sum(1))}"
    assert np.array_equal(_bits(reference.dequant(w, t).numpy()), _bits(ref))


@pytest.mark.parametrize("isa", isa_params())
def test_mxfp4_every_code_and_scale(isa, use_isa):
    """All 256 scale bytes (incl. subnormal e=0,1) and all 256 nibble pairs, against the torch twin."""
    use_isa(isa)
    blocks = np.zeros((256, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(256)
    blocks[:, 1:] = (np.arange(256)[:, None] + np.arange(16)[None, :] * 17) % 256
    mine = K.dequantize(blocks, GGMLType.MXFP4)
    assert np.array_equal(_bits(mine), _bits(reference.dequant(blocks, GGMLType.MXFP4).numpy()))
    # Worked example (gguf-mxfp4.md §4): bytes 7F 2F 00.. -> element 0 = -6.0, element 16 = 1.0.
    example = np.zeros((1, 17), dtype=np.uint8)
    example[0, :2] = (0x7F, 0x2F)
    got = K.dequantize(example, GGMLType.MXFP4)[0]
    assert got[0] == -6.0 and got[16] == 1.0 and np.count_nonzero(got) == 2


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("T", [1, 3, 4, 5, 8, 9, 33])
def test_linear_matches_dequant_matmul(isa, t, T, use_isa, act_mode):
    use_isa(isa)
    rng = np.random.default_rng()
    N, Kd = 41, 2880 if T == 1 else 320  # odd row count; one full gpt-oss width
    w = quantized(rng, N, Kd, t)
    x = torch.from_numpy(rng.standard_normal((T, Kd), dtype=np.float32))
    bias = torch.from_numpy(rng.standard_normal(N, dtype=np.float32))
    fn = K.linear_mxfp4 if t == GGMLType.MXFP4 else K.linear_q8_0
    y = fn(x, w, bias, act=act_mode)
    ref = x.double() @ dequant64(w, t).T + bias.double()
    assert y.shape == (T, N) and y.dtype == torch.float32
    assert rel_err(y, ref) < default_tol(LINEAR_TOL, act_mode)
    assert rel_err(reference.linear(x, w, t, bias), ref) < LINEAR_TOL


@pytest.mark.parametrize("t", TYPES)
def test_gemv_and_tile_paths_agree(t, use_isa, act_mode):
    """The same tokens through the streaming GEMV and through tile+GEMM (forced crossover)."""
    rng = np.random.default_rng()
    w = quantized(rng, 50, 256, t)
    x = torch.from_numpy(rng.standard_normal((12, 256), dtype=np.float32))
    K.set_gemv_max_tokens(64)
    a = K._linear(x, w, None, t, act_mode)
    K.set_gemv_max_tokens(0)
    b = K._linear(x, w, None, t, act_mode)
    assert rel_err(a, b) < default_tol(LINEAR_TOL, act_mode)


@pytest.mark.parametrize("isa", isa_params())
def test_each_format_has_its_own_fp32_crossover(isa, use_isa):
    """By default 40 tokens take the GEMV for MXFP4 weights where the kernel set's GEMV keeps up
    with its GEMM that long (AVX-512: to 48 tokens; AVX2 and scalar: 14 and 16), and the tile GEMM
    for Q8_0 (from 17): the same bits as forcing that path. Setting one format's crossover leaves
    the other's; None restores the defaults."""
    use_isa(isa)
    mx_default = {"avx512": 48, "avx2": 14, "scalar": 16}[isa]
    assert K.gemv_max_tokens(GGMLType.MXFP4) == mx_default and K.gemv_max_tokens(GGMLType.Q8_0) == 16
    rng = np.random.default_rng()
    x = torch.from_numpy(rng.standard_normal((40, 256), dtype=np.float32))
    formats = (GGMLType.MXFP4, GGMLType.Q8_0)
    w = {t: quantized(rng, 50, 256, t) for t in formats}
    default = {t: K._linear(x, w[t], None, t, K.Activations.FP32) for t in formats}
    forced = {}
    for t in formats:
        forced[t] = {}
        for path, n in (("gemv", 64), ("tile", 0)):
            K.set_gemv_max_tokens(n)
            forced[t][path] = K._linear(x, w[t], None, t, K.Activations.FP32)
    assert all(not torch.equal(forced[t]["gemv"], forced[t]["tile"]) for t in formats)  # paths tell apart
    assert torch.equal(default[GGMLType.MXFP4], forced[GGMLType.MXFP4]["gemv" if mx_default >= 40 else "tile"])
    assert torch.equal(default[GGMLType.Q8_0], forced[GGMLType.Q8_0]["tile"])
    K.set_gemv_max_tokens(7, ggml_type=GGMLType.Q8_0)
    assert K.gemv_max_tokens(GGMLType.Q8_0) == 7 and K.gemv_max_tokens(GGMLType.MXFP4) == 0
    K.set_gemv_max_tokens(None)
    assert K.gemv_max_tokens(GGMLType.MXFP4) == mx_default and K.gemv_max_tokens(GGMLType.Q8_0) == 16
    with pytest.raises(ValueError, match="ggml_type"):
        K.set_gemv_max_tokens(3, ggml_type=GGMLType.F32)


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("T", [9, 17, 24, 40])
def test_tile_gemm_k_blocks_with_a_tail(isa, t, T, use_isa):
    """K = 704: the GEMMs' K blocking (AVX2 320, AVX-512 160) runs full blocks and a 64-wide tail;
    T = 9 takes the few-token qgemm, 17-40 the GEMM with token groups in pairs and one left over
    (AVX2 groups of 8, AVX-512 of 16); 71 rows: two row blocks, neither a whole number of panels."""
    use_isa(isa)
    rng = np.random.default_rng()
    w = quantized(rng, 71, 704, t)
    x = torch.from_numpy(rng.standard_normal((T, 704), dtype=np.float32))
    K.set_gemv_max_tokens(0)  # force tile + GEMM
    y = K._linear(x, w, None, t)
    ref = x.double() @ dequant64(w, t).T
    assert torch.isfinite(y).all() and rel_err(y, ref) < LINEAR_TOL


def test_linear_nan_propagates(act_mode):
    rng = np.random.default_rng()
    w = quantized(rng, 24, 64, GGMLType.Q8_0)
    for T in (1, 12):  # GEMV and tile paths
        x = torch.from_numpy(rng.standard_normal((T, 64), dtype=np.float32))
        x[0, 5] = float("nan")
        y = K.linear_q8_0(x, w, act=act_mode)
        assert torch.isnan(y[0]).all()
        assert torch.isfinite(y[1:]).all()


def test_linear_strided_rows():
    """Rows with a stride larger than the row (a column slice of a wider byte matrix)."""
    rng = np.random.default_rng()
    big = quantized(rng, 30, 128, GGMLType.MXFP4)
    w = big[:, : 64 // 32 * 17]  # first 64 inputs of each row, rows 68 bytes apart
    x = torch.from_numpy(rng.standard_normal((2, 64), dtype=np.float32))
    ref = x.double() @ dequant64(np.ascontiguousarray(w), GGMLType.MXFP4).T
    assert rel_err(K.linear_mxfp4(x, w), ref) < LINEAR_TOL


def test_linear_bad_input_is_named():
    w = np.zeros((4, 34), dtype=np.uint8)
    with pytest.raises(ValueError, match="inputs per row"):
        K.linear_q8_0(torch.zeros(1, 64), w)
    with pytest.raises(ValueError, match="float32"):
        K.linear_q8_0(torch.zeros(1, 32, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="whole number"):
        K.linear_q8_0(torch.zeros(1, 32), np.zeros((4, 33), dtype=np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        K.linear_q8_0(torch.zeros(1, 32), np.zeros((4, 34), dtype=np.int8))
    with pytest.raises(ValueError, match="bias"):
        K.linear_q8_0(torch.zeros(1, 32), w, torch.zeros(5))


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("T", [1, 3, 20])  # GEMV, several tokens, tile + GEMM
def test_linear_group_equals_separate_calls(isa, T, use_isa, act_mode):
    """q/k/v-style group: one call, outputs side by side, bit-identical to one call per matrix
    (same kernel, same input preparation); row counts that do not fill a 24-row work unit."""
    use_isa(isa)
    rng = np.random.default_rng()
    ws = [quantized(rng, n, 320, GGMLType.Q8_0) for n in (64, 16, 37)]
    biases = [torch.from_numpy(rng.standard_normal(64, dtype=np.float32)), None,
              torch.from_numpy(rng.standard_normal(37, dtype=np.float32))]
    group = K.LinearGroup(ws, biases, GGMLType.Q8_0, act=act_mode)
    x = torch.from_numpy(rng.standard_normal((T, 320), dtype=np.float32))
    y = group(x)
    assert y.shape == (T, 117) and group.sizes == [64, 16, 37]
    for part, w, b in zip(torch.split(y, group.sizes, dim=1), ws, biases):
        assert torch.equal(part, K.linear_q8_0(x, w, b, act=act_mode))
        ref = x.double() @ dequant64(w, GGMLType.Q8_0).T + (0 if b is None else b.double())
        assert rel_err(part, ref) < default_tol(LINEAR_TOL, act_mode)


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("T", [1, 3])
def test_long_matrices_take_long_units_with_the_same_bits(isa, T, use_isa, act_mode):
    """Matrices of >= 768 rows are cut into 96-row GEMV units (shorter ones into 24): still close to
    float64, bit-identical at 1 and 2 threads and alone or in a group (odd row counts included)."""
    use_isa(isa)
    rng = np.random.default_rng()
    ws = [quantized(rng, n, 256, t) for n, t in ((1001, GGMLType.Q8_0), (768, GGMLType.Q8_0), (95, GGMLType.Q8_0))]
    x = torch.from_numpy(rng.standard_normal((T, 256), dtype=np.float32))
    K.set_num_threads(1)
    one = [K.linear_q8_0(x, w, act=act_mode) for w in ws]
    K.set_num_threads(2)
    two = [K.linear_q8_0(x, w, act=act_mode) for w in ws]
    grouped = torch.split(K.LinearGroup(ws, [None] * 3, GGMLType.Q8_0, act=act_mode)(x), [1001, 768, 95], dim=1)
    for w, a, b, g in zip(ws, one, two, grouped):
        assert torch.equal(a, b) and torch.equal(a, g)
        assert rel_err(a, x.double() @ dequant64(w, GGMLType.Q8_0).T) < default_tol(LINEAR_TOL, act_mode)
    wm = quantized(rng, 999, 256, GGMLType.MXFP4)
    ym = K.linear_mxfp4(x, wm, act=act_mode)
    assert rel_err(ym, x.double() @ dequant64(wm, GGMLType.MXFP4).T) < default_tol(LINEAR_TOL, act_mode)


def test_linear_group_bad_input_is_named():
    rng = np.random.default_rng()
    a, b = quantized(rng, 8, 320, GGMLType.Q8_0), quantized(rng, 8, 256, GGMLType.Q8_0)
    with pytest.raises(ValueError, match="share the input size"):
        K.LinearGroup([a, b], [None, None], GGMLType.Q8_0)
    with pytest.raises(ValueError, match=r"biases\[0\] has shape"):
        K.LinearGroup([a], [torch.zeros(7)], GGMLType.Q8_0)
    group = K.LinearGroup([a], [None], GGMLType.Q8_0)
    with pytest.raises(ValueError, match=r"x must be \[T, 320\]"):
        group(torch.zeros(1, 256))


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("T", [2, 3, 4, 6, 8, 11, 16])
def test_gemv_k_chunks_row_groups_and_even_passes(isa, t, T, use_isa, act_mode):
    """K = 2880 and 53 rows through the streaming GEMV: the AVX2 variant (and the AVX-512 one at 3-4
    tokens) walks K in chunks (32 to 8 blocks per chunk, with a partial last one) over groups of 24
    rows (two full and a tail), and
    11 or 16 tokens run as two even passes; against float64 on the dequantized weights."""
    use_isa(isa)
    rng = np.random.default_rng()
    w = quantized(rng, 53, 2880, t)
    x = torch.from_numpy(rng.standard_normal((T, 2880), dtype=np.float32))
    K.set_gemv_max_tokens(16)
    y = K._linear(x, w, None, t, act_mode)
    ref = x.double() @ dequant64(w, t).T
    assert torch.isfinite(y).all() and rel_err(y, ref) < default_tol(LINEAR_TOL, act_mode)


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("T", [1, 2, 5])
def test_mxfp4_gemv_every_scale_regime(isa, T, use_isa, act_mode):
    """Scale bytes at both ends (subnormal e = 0, 1; e up to 252, where +-6 still fits float32),
    alone and mixed with ordinary ones in one row, activations scaled so every result is a normal
    float. Each output's error against float64 relative to its sum of |w x| (a cancelling row is not
    held to its tiny result, and a tiny row is not hidden by a large one)."""
    use_isa(isa)
    rng = np.random.default_rng()
    rows, Kd = 23, 640  # 20 blocks per row, an odd row count
    regimes = {"low": ([0, 1, 2, 3], 2.0 ** 20), "high": ([248, 250, 251, 252], 2.0 ** -20),
               "mixed": ([0, 1, 2, 120, 127, 130, 252], 2.0 ** -20), "ordinary": ([118, 127, 133], 1.0)}
    for name, (scales, x_scale) in regimes.items():
        w = quantized(rng, rows, Kd, GGMLType.MXFP4).reshape(rows, Kd // 32, 17)
        w[:, :, 0] = rng.choice(scales, size=(rows, Kd // 32))
        w = np.ascontiguousarray(w.reshape(rows, -1))
        x = torch.from_numpy((rng.standard_normal((T, Kd)) * x_scale).astype(np.float32))
        K.set_gemv_max_tokens(16)
        y = K._linear(x, w, None, GGMLType.MXFP4, act_mode)
        w64 = dequant64(w, GGMLType.MXFP4)
        ref, scale = x.double() @ w64.T, x.double().abs() @ w64.abs().T  # error relative to sum |w x|
        per_row = ((y.double() - ref).abs() / scale.clamp_min(1e-300)).max().item()
        assert per_row < default_tol(LINEAR_TOL, act_mode), (name, per_row)


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("Kd", [352, 2912])  # 11 and 91 blocks
@pytest.mark.parametrize("T", [1, 2, 3, 5, 8])
def test_gemv_odd_block_count(isa, Kd, T, use_isa, act_mode):
    """An odd number of MXFP4 blocks per row through the streaming GEMV, unchunked and (2912 with
    3+ tokens) after K chunks that end on a partial one; against float64."""
    use_isa(isa)
    rng = np.random.default_rng()
    w = quantized(rng, 29, Kd, GGMLType.MXFP4)
    x = torch.from_numpy(rng.standard_normal((T, Kd), dtype=np.float32))
    K.set_gemv_max_tokens(16)
    y = K._linear(x, w, None, GGMLType.MXFP4, act_mode)
    ref = x.double() @ dequant64(w, GGMLType.MXFP4).T
    assert torch.isfinite(y).all() and rel_err(y, ref) < default_tol(LINEAR_TOL, act_mode)
