"""The 4/5-bit and K-quant block types: dequantize bit-exact vs gguf.quants on random blocks (NaN
and inf scales included), torch twin bit-exact vs numpy, quantize (ggml's reference for the
legacy four, our one-pass quantizer for the rest) within stated round-trip bounds, the exact Q8_0
transcode, size errors naming the type, and `hybridmoe inspect` on a file of these types."""

from __future__ import annotations

import io

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from hybridmoe.commands.inspect import print_model
from hybridmoe.gguf import TensorSpec, open_model, write_gguf
from hybridmoe.gguf.constants import BLOCK_SIZES
from hybridmoe.gguf.constants import GGMLType as T
from hybridmoe.quant import Q8_0_EXACT_TYPES, to_q8_0
from hybridmoe.quant import block_types as bt
from hybridmoe.quant.formats import SUPPORTED, dequantize, quantize
from hybridmoe.quant.torch_dequant import dequantize_torch
from tests.test_quant_formats import _same_bits

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL, T.IQ4_XS,
         T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
LEGACY = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]
# byte offsets of the f16 fields in one block (ggml-common.h): d first, dmin / m where present
F16_AT = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.IQ4_NL: (0,),
          T.IQ4_XS: (0,), T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2),
          T.Q6_K: (208,)}
# stated bounds on the relative RMS error of dequantize(quantize(x)) for Gaussian rows (measured:
# Q2_K 0.33, Q3_K 0.156, Q4_0 0.086, Q4_1 0.079, IQ4_NL/IQ4_XS 0.080, Q4_K 0.079, Q5_0 0.043,
# Q5_1 0.038, Q5_K 0.038, Q6_K 0.019)
RT_BOUND = {T.Q2_K: 0.36, T.Q3_K: 0.18, T.Q4_0: 0.10, T.Q4_1: 0.10, T.IQ4_NL: 0.10,
            T.IQ4_XS: 0.10, T.Q4_K: 0.10, T.Q5_0: 0.05, T.Q5_1: 0.05, T.Q5_K: 0.05,
            T.Q6_K: 0.025}
F16_NAN, F16_INF = 0x7E00, 0x7C00


def _gq(t: T) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType(int(t))


def _gguf_values(raw: np.ndarray, t: T) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 in gguf's own code
        return gguf_dequantize(raw, _gq(t))


def _name(t: T) -> str:
    return t.name


def _raw(t: T, seed: int, lead=(3, 5), nblocks: int = 3) -> np.ndarray:
    """Random blocks [*lead, nblocks*block_bytes] whose f16 fields are sane finite values."""
    rng = np.random.default_rng(seed)
    bb = BLOCK_SIZES[t][1]
    raw = rng.integers(0, 256, lead + (nblocks, bb), dtype=np.uint8)
    for at in F16_AT[t]:
        shape = lead + (nblocks, 1)
        v = rng.uniform(-2, 2, shape) * 2.0 ** rng.integers(-12, 8, shape)
        raw[..., at:at + 2] = v.astype(np.float16).view(np.uint8)
    return raw.reshape(lead + (-1,))


def _with_bad_scales(t: T, seed: int) -> np.ndarray:
    """_raw with NaN in every f16 field of block [0, 0, 1] and inf in d of block [1, 2, 0]."""
    raw = _raw(t, seed)
    b = raw.reshape(3, 5, 3, -1)
    for at in F16_AT[t]:
        b[0, 0, 1, at:at + 2] = np.array([F16_NAN], np.uint16).view(np.uint8)
    b[1, 2, 0, F16_AT[t][0]:F16_AT[t][0] + 2] = np.array([F16_INF], np.uint16).view(np.uint8)
    return raw


def test_tables_agree():
    assert set(bt.TYPES) == set(TYPES) and set(TYPES) <= set(SUPPORTED)
    assert bt.F16_FIELDS == F16_AT
    assert set(Q8_0_EXACT_TYPES) == {T.Q4_0, T.Q5_0, T.IQ4_NL}


# ---- dequantize vs gguf.quants -------------------------------------------------------------------
@pytest.mark.parametrize("t", TYPES, ids=_name)
def test_dequantize_matches_gguf(t):
    raw = _raw(t, 10 + int(t))
    qk = BLOCK_SIZES[t][0]
    got = dequantize(raw, t)
    assert got.dtype == np.float32 and got.shape == (3, 5, 3 * qk)
    assert np.isfinite(got).all()
    assert _same_bits(got, _gguf_values(raw, t))


@pytest.mark.parametrize("t", TYPES, ids=_name)
def test_nan_and_inf_scales_propagate_as_gguf(t):
    raw = _with_bad_scales(t, 20 + int(t))
    got = dequantize(raw, t)
    assert _same_bits(got, _gguf_values(raw, t))
    qk = BLOCK_SIZES[t][0]
    blocks = got.reshape(3, 5, 3, qk)
    assert np.isnan(blocks[0, 0, 1]).all()
    assert not np.isfinite(blocks[1, 2, 0]).any()  # inf * q, and inf * 0 = NaN
    assert np.isfinite(np.delete(blocks.reshape(-1, qk), [1, 21], axis=0)).all()


def test_q4_0_and_q5_0_hand_blocks():
    d = np.array([0.5], np.float16).view(np.uint8)
    qs = np.array([j | ((15 - j) << 4) for j in range(16)], np.uint8)
    w = dequantize(np.concatenate([d, qs]), T.Q4_0)
    assert np.array_equal(w, 0.5 * np.r_[np.arange(16) - 8, 7 - np.arange(16)])
    qh = np.array([0x8000_0001], np.uint32).view(np.uint8)  # 5th bit of elements 0 and 31
    w5 = dequantize(np.concatenate([d, qh, qs]), T.Q5_0)
    want = 0.5 * np.r_[np.arange(16) - 16, 15 - np.arange(16) - 16]
    want[0] += 8
    want[31] += 8
    assert np.array_equal(w5, want)


# ---- torch twin ----------------------------------------------------------------------------------
@pytest.mark.parametrize("t", TYPES, ids=_name)
def test_torch_matches_numpy_bit_exact(t):
    raw = _with_bad_scales(t, 30 + int(t))
    got = dequantize_torch(torch.from_numpy(raw), t)
    assert got.dtype == torch.float32 and tuple(got.shape) == (3, 5, 3 * BLOCK_SIZES[t][0])
    assert _same_bits(got.numpy(), dequantize(raw, t))
    sl = dequantize_torch(torch.from_numpy(raw)[:, ::2], t)  # non-contiguous rows
    assert _same_bits(sl.numpy(), dequantize(raw[:, ::2], t))


# ---- quantize ------------------------------------------------------------------------------------
def _edge_values(rng, n: int) -> np.ndarray:
    """Rows at scales 1e-4..1e4, plus a zero, a tiny and a one-spike block."""
    x = rng.standard_normal((12, n)) * 10.0 ** rng.uniform(-4, 4, (12, 1))
    x[0, :256] = 0
    x[1, :256] = 1e-30 * rng.standard_normal(256)
    x[2, 256:512] = 0
    x[2, 300] = 3.7
    return x.astype(np.float32)


@pytest.mark.parametrize("t", LEGACY, ids=_name)
def test_legacy_quantize_matches_gguf(t):
    x = _edge_values(np.random.default_rng(40 + int(t)), 512)
    got = quantize(x, t)
    with np.errstate(all="ignore"):
        ref = np.ascontiguousarray(gguf_quantize(x, _gq(t))).view(np.uint8).reshape(got.shape)
    assert got.dtype == np.uint8 and np.array_equal(got, ref)


@pytest.mark.parametrize("t", TYPES, ids=_name)
def test_round_trip_within_bound(t):
    rng = np.random.default_rng(50 + int(t))
    x = (rng.standard_normal((24, 1024)) * 10.0 ** rng.uniform(-2, 2, (24, 1))).astype(np.float32)
    shifted = (rng.standard_normal((8, 1024)) + 3).astype(np.float32)  # mins / one-sided blocks
    for data in (x, shifted):
        q = quantize(data[None], t)  # a leading axis passes through
        assert q.shape == (1, len(data), 1024 // BLOCK_SIZES[t][0] * BLOCK_SIZES[t][1])
        y = dequantize(q, t)[0]
        rel = np.sqrt(((y - data) ** 2).sum(-1) / (data**2).sum(-1))
        assert rel.max() < RT_BOUND[t], (t.name, rel.max())
    e = _edge_values(rng, 512)
    y = dequantize(quantize(e, t), t)
    assert np.isfinite(y).all()
    assert np.array_equal(y[0, :256], np.zeros(256)) and np.abs(y[1, :256]).max() < 1e-20
    assert abs(y[2, 300] - 3.7) < 0.05 * 3.7 and np.abs(y[2, 256:512]).max() <= 3.7 * 1.05
    big = np.abs(e).max(-1) > 1e-3
    rel = np.linalg.norm(y[big] - e[big], axis=-1) / np.linalg.norm(e[big], axis=-1)
    assert rel.max() < 2 * RT_BOUND[t]


# ---- Q8_0 transcode ------------------------------------------------------------------------------
@pytest.mark.parametrize("t", [T.Q4_0, T.Q5_0, T.IQ4_NL], ids=_name)
def test_to_q8_0_is_exact(t):
    raw = _with_bad_scales(t, 60 + int(t))
    q8 = to_q8_0(raw, t)
    assert q8.dtype == np.uint8 and q8.shape == (3, 5, 3 * 34)
    assert np.array_equal(q8.reshape(3, 5, 3, 34)[..., :2], raw.reshape(3, 5, 3, -1)[..., :2])
    assert _same_bits(dequantize(q8, T.Q8_0), dequantize(raw, t))
    with pytest.raises(ValueError, match=f"to_q8_0 {t.name}: last axis of 35 bytes"):
        to_q8_0(np.zeros(35, np.uint8), t)


def test_to_q8_0_refuses_other_types():
    with pytest.raises(ValueError, match="Q4_1 has no exact Q8_0 form"):
        to_q8_0(np.zeros(20, np.uint8), T.Q4_1)


# ---- bit-field helpers ---------------------------------------------------------------------------
@pytest.mark.parametrize("group,bits", [(16, 4), (1, 1), (32, 2), (32, 1), (64, 4), (1, 4), (1, 2),
                                        (8, 4), (4, 2)])
def test_pack_unpack_inverse(group, bits):
    rng = np.random.default_rng(group * 10 + bits)
    v = rng.integers(0, 1 << bits, (2, 3, 8 // bits * group * 2), dtype=np.uint8)
    packed = bt.pack_bits(v, group, bits)
    assert packed.shape == (2, 3, 2 * group)
    assert np.array_equal(bt.unpack_bits(packed, group, bits), v)


def test_k_scales_pack_unpack_inverse():
    rng = np.random.default_rng(3)
    sc, mn = rng.integers(0, 64, (2, 50, 8), dtype=np.uint8)
    back = bt.k_scales_unpack(bt.k_scales_pack(sc, mn))
    assert np.array_equal(back[0], sc) and np.array_equal(back[1], mn)


# ---- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("t", TYPES, ids=_name)
def test_bad_sizes_name_the_type(t):
    qk, bb = BLOCK_SIZES[t]
    with pytest.raises(ValueError, match=f"dequantize {t.name}: last axis of {bb + 1} bytes"):
        dequantize(np.zeros((2, bb + 1), np.uint8), t)
    with pytest.raises(ValueError, match=f"dequantize_torch {t.name}: .*{bb}-byte block"):
        dequantize_torch(torch.zeros(2, 2 * bb - 1, dtype=torch.uint8), t)
    with pytest.raises(ValueError, match=f"quantize {t.name}: .*multiple of {qk}"):
        quantize(np.zeros((2, qk + 16), np.float32), t)
    with pytest.raises(ValueError, match=f"quantize {t.name}: input holds NaN or inf"):
        quantize(np.r_[np.ones(qk - 1), np.inf].astype(np.float32), t)
    with pytest.raises(ValueError, match=f"quantize {t.name}: .*overflow the f16 block scale"):
        quantize(np.full(qk, 1e30, np.float32), t)
    with pytest.raises(ValueError, match=f"dequantize {t.name}: raw must be uint8"):
        dequantize(np.zeros(bb, np.float32), t)


# ---- a GGUF of these types: written, inspected, read back ----------------------------------------
def test_inspect_and_read_back(tmp_path):
    rng = np.random.default_rng(70)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    data = {t: quantize(x, t) for t in TYPES}
    path = tmp_path / "bt.gguf"
    write_gguf(path, {"general.architecture": "gpt-oss"},
               [TensorSpec(f"w.{t.name}", t, (512, 2), data[t]) for t in TYPES])
    out = io.StringIO()
    with open_model(path) as m:
        print_model(m, out=out)
        for t in TYPES:
            assert np.array_equal(dequantize(m.raw(f"w.{t.name}"), t), dequantize(data[t], t))
    text = out.getvalue()
    for t in TYPES:
        nbytes = 2 * 512 // BLOCK_SIZES[t][0] * BLOCK_SIZES[t][1]
        assert f"  w.{t.name:<6}  {t.name:<6}  [512, 2]" in text and f"{nbytes:>14,}" in text
