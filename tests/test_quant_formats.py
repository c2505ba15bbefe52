"""Reference (de)quantizers: hand-computed blocks, bit-exact vs gguf.quants, round-trip bounds,
torch twins bit-exact vs numpy, HF MXFP4 repacking vs the HF decoding formula."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from hybridmoe.gguf.constants import GGMLType as T
from hybridmoe.quant.formats import dequantize, mxfp4_from_hf, quantize
from hybridmoe.quant.torch_dequant import dequantize_torch
from hybridmoe.quant.torch_dequant import mxfp4_from_hf as mxfp4_from_hf_torch

TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.MXFP4]
ROW_BYTES = {T.F32: 4 * 64, T.F16: 2 * 64, T.BF16: 2 * 64, T.Q8_0: 2 * 34, T.MXFP4: 2 * 17}
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def _gq(t: T) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType(int(t))


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-identical float32 arrays; NaNs must sit at the same places (any payload)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if a.shape != b.shape or not np.array_equal(np.isnan(a), np.isnan(b)):
        return False
    ok = ~np.isnan(a)
    return np.array_equal(a[ok].view(np.uint32), b[ok].view(np.uint32))


# ---- hand-computed blocks ----------------------------------------------------------------------
def test_mxfp4_worked_example():
    block = np.zeros(17, np.uint8)
    block[0], block[1] = 0x7F, 0x2F  # e = 127 -> d = 0.5; qs[0]: low code 15, high code 2
    w = dequantize(block, T.MXFP4)
    want = np.zeros(32, np.float32)
    want[0], want[16] = -6.0, 1.0
    assert np.array_equal(w, want)


def test_mxfp4_all_codes_nibble_order():
    # qs[j] = code j (low) | code 15-j (high): element j = E2M1[j], element j+16 = E2M1[15-j]
    block = np.array([130] + [j | ((15 - j) << 4) for j in range(16)], np.uint8)  # scale 2^3
    w = dequantize(block, T.MXFP4)
    assert np.array_equal(w[:16], E2M1 * 8) and np.array_equal(w[16:], E2M1[::-1] * 8)


def test_mxfp4_every_exponent():
    rng = np.random.default_rng(9)
    e = np.arange(255)
    codes = rng.integers(0, 16, (255, 32))
    blocks = np.concatenate([e[:, None], codes[:, :16] | (codes[:, 16:] << 4)], 1).astype(np.uint8)
    with np.errstate(over="ignore"):  # +-6 * 2^127 is past float32 max: inf, as in ggml
        want = (E2M1[codes] * 2.0 ** (e[:, None] - 127)).astype(np.float32)
    got = dequantize(blocks, T.MXFP4)
    assert np.array_equal(got, want)
    assert np.array_equal(got[:253], want[:253]) and np.isfinite(got[:253]).all()
    assert _same_bits(got, dequantize_torch(torch.from_numpy(blocks), T.MXFP4).numpy())


def test_q8_0_hand_block():
    qs = np.arange(-16, 16, dtype=np.int8)
    block = np.concatenate([np.array([0.5], np.float16).view(np.uint8), qs.view(np.uint8)])
    assert np.array_equal(dequantize(block, T.Q8_0), 0.5 * np.arange(-16, 16, dtype=np.float32))


def test_16bit_hand_values():
    bf = np.array([0x3F80, 0xC040, 0x0000, 0x7F80], np.uint16)  # 1, -3, 0, inf
    assert np.array_equal(dequantize(bf.view(np.uint8), T.BF16), [1.0, -3.0, 0.0, np.inf])
    f16 = np.array([0x3C00, 0xC200, 0x3800], np.uint16)  # 1, -3, 0.5
    assert np.array_equal(dequantize(f16.view(np.uint8), T.F16), [1.0, -3.0, 0.5])


# ---- vs gguf.quants on fresh random bytes ------------------------------------------------------
@pytest.mark.parametrize("t", TYPES)
def test_dequantize_random_bytes_matches_gguf(t):
    rng = np.random.default_rng(100 + int(t))
    raw = rng.integers(0, 256, (3, 5, ROW_BYTES[t]), dtype=np.uint8)
    if t == T.MXFP4:
        raw[..., ::17] = rng.integers(0, 255, raw[..., ::17].shape)  # e = 255 (NaN) is undefined
    got = dequantize(raw, t)
    assert got.dtype == np.float32 and got.shape == (3, 5, 64)
    ref = gguf_dequantize(raw, _gq(t)).astype(np.float32)
    assert _same_bits(got, ref)
    assert not np.isnan(got).any() or t in (T.F32, T.F16, T.BF16)


def _random_values(rng, shape):
    """Normal values with per-row scales over 12 decades, plus zero / tiny / one-spike blocks."""
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-6, 6, shape[:-1] + (1,))
    x[0, :32] = 0
    x[1, :32] = 1e-30 * rng.standard_normal(32)
    x[2, 32:64] = 0
    x[2, 40] = 3.7
    return x.astype(np.float32)


@pytest.mark.parametrize("t", TYPES)
def test_quantize_matches_gguf(t):
    x = _random_values(np.random.default_rng(200 + int(t)), (16, 256))
    got = quantize(x, t)
    with np.errstate(over="ignore"):
        ref = np.ascontiguousarray(gguf_quantize(x, _gq(t))).view(np.uint8).reshape(got.shape)
    assert got.dtype == np.uint8
    assert np.array_equal(got, ref)


def test_q8_0_round_trip_bound():
    x = _random_values(np.random.default_rng(5), (64, 512))
    y = dequantize(quantize(x, T.Q8_0), T.Q8_0)
    blocks = x.reshape(-1, 32)
    d = np.abs(blocks).max(-1, keepdims=True) / 127
    err = np.abs(y.reshape(-1, 32) - blocks)
    # half a step, plus the f16 rounding of d (rel 2^-11) times |q| <= 127, plus subnormal-d slack
    assert np.all(err <= d * (0.5 + 127 * 2.0**-11) + 127 * 2.0**-25)
    big = np.abs(blocks).max(-1) > 1e-3
    rel = np.linalg.norm(y.reshape(-1, 32)[big] - blocks[big]) / np.linalg.norm(blocks[big])
    assert rel < 0.01  # stated: ~0.4% typical for Gaussian blocks


def test_mxfp4_round_trip_bound():
    x = _random_values(np.random.default_rng(6), (64, 512))
    q = quantize(x, T.MXFP4)
    y = dequantize(q, T.MXFP4).reshape(-1, 32)
    blocks = x.reshape(-1, 32)
    s = 2.0 ** (q.reshape(-1, 17)[:, :1].astype(np.float64) - 127)  # block scale
    err = np.abs(y - blocks)
    inside = np.abs(blocks) <= 6 * s
    # nearest of E2M1 grid: at most half the widest gap (4 -> 6) = 1 * s; clipped above 6s: < 2s
    assert np.all(err[inside] <= s.repeat(32, 1)[inside])
    assert np.all(err <= 2 * s)
    assert np.isfinite(y).all()


def test_mxfp4_requantize_is_lossless():
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, (200, 17), dtype=np.uint8)
    raw[:, 0] = rng.integers(3, 253, 200)  # e < 3 may need a negative exponent; e > 252 inf
    v = dequantize(raw, T.MXFP4)
    assert np.array_equal(dequantize(quantize(v, T.MXFP4), T.MXFP4), v)


def test_bf16_quantize_rounding():
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, np.nan, -np.inf, 3.4e38], np.float32)
    y = dequantize(quantize(x, T.BF16), T.BF16)
    assert y[0] == 1.0 and y[1] == 1.0  # tie -> even
    assert y[2] == 1.0 + 4 * 2**-8  # tie -> even (up)
    assert np.isnan(y[3]) and y[4] == -np.inf and y[5] == np.inf


# ---- torch twins -------------------------------------------------------------------------------
@pytest.mark.parametrize("t", TYPES)
def test_torch_matches_numpy_bit_exact(t):
    rng = np.random.default_rng(300 + int(t))
    raw = rng.integers(0, 256, (2, 7, ROW_BYTES[t] * 3), dtype=np.uint8)
    if t == T.MXFP4:
        raw[..., ::17] = rng.integers(0, 255, raw[..., ::17].shape)
    got = dequantize_torch(torch.from_numpy(raw), t)
    assert got.dtype == torch.float32 and tuple(got.shape) == (2, 7, 192)
    assert _same_bits(got.numpy(), dequantize(raw, t))
    # non-contiguous input (a slice along the rows) gives the same values
    sl = dequantize_torch(torch.from_numpy(raw)[:, ::2], t)
    assert _same_bits(sl.numpy(), dequantize(raw[:, ::2], t))


# ---- HF / OpenAI MXFP4 -> ggml ----------------------------------------------------------------
def _hf_decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The HF/OpenAI formula (reference §7.3): pairwise nibbles, ldexp by scale - 127."""
    out = np.empty(blocks.shape[:-1] + (32,), np.float64)
    out[..., 0::2] = E2M1[blocks & 0x0F]
    out[..., 1::2] = E2M1[blocks >> 4]
    out = np.ldexp(out, scales[..., None].astype(np.int32) - 127)
    return out.reshape(scales.shape[:-1] + (-1,))


def test_mxfp4_from_hf_matches_hf_decoding():
    rng = np.random.default_rng(8)
    blocks = rng.integers(0, 256, (4, 6, 3, 16), dtype=np.uint8)  # [E, rows, nb, 16]
    scales = rng.integers(100, 150, (4, 6, 3), dtype=np.uint8)
    g = mxfp4_from_hf(blocks, scales)
    assert g.shape == (4, 6, 3 * 17) and g.dtype == np.uint8
    assert np.array_equal(g.reshape(4, 6, 3, 17)[..., 0], scales)
    want = _hf_decode(blocks, scales)
    assert np.array_equal(dequantize(g, T.MXFP4), want.astype(np.float32))
    gt = mxfp4_from_hf_torch(torch.from_numpy(blocks), torch.from_numpy(scales))
    assert gt.dtype == torch.uint8 and np.array_equal(gt.numpy(), g)


# ---- errors ------------------------------------------------------------------------------------
def test_errors_are_clear():
    with pytest.raises(ValueError, match="IQ2_XXS not supported"):
        dequantize(np.zeros(66, np.uint8), T.IQ2_XXS)
    with pytest.raises(ValueError, match="unknown ggml type id 99"):
        quantize(np.zeros(32, np.float32), 99)
    with pytest.raises(ValueError, match="not a multiple of the 17-byte block"):
        dequantize(np.zeros(18, np.uint8), T.MXFP4)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(np.zeros(33, np.float32), T.Q8_0)
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize(np.full(32, np.nan, np.float32), T.MXFP4)
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize(np.zeros(34, np.int32), T.Q8_0)
    with pytest.raises(ValueError, match="34-byte block"):
        dequantize_torch(torch.zeros(35, dtype=torch.uint8), T.Q8_0)
    with pytest.raises(ValueError, match="uint8 tensor"):
        dequantize_torch(torch.zeros(34), T.Q8_0)
    with pytest.raises(ValueError, match="must be scales"):
        mxfp4_from_hf(np.zeros((2, 16), np.uint8), np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match="must be scales"):
        mxfp4_from_hf_torch(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8))
