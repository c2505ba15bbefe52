"""The ext-format decoders (Q4_0 .. Q6_K, IQ4_NL, IQ4_XS) and the fused GEMV of every ISA,
reached directly through the library's hm_ext_* test entry points.

Decoding must equal the gguf package's numpy dequantize bit for bit (NaN positions included);
the GEMV must be within 1e-6 of the float64 product of numpy's decoded weights, relative to
sum |w x| (the scale that bounds any fp32 summation order's error; relative to |dot| alone,
cancellation makes any fp32 order fail).
"""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest

from hybridmoe.kernels import _lib

_LIB = _lib.load()[0]
pytestmark = pytest.mark.skipif(_LIB is None, reason="compiled kernels not built (torch fallback only)")

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
if _LIB is not None:
    for _name, _args in {
        "hm_ext_decode": [_I32, _I32, _P, _I64, _I64, _I64, _P],
        "hm_ext_gemv": [_I32, _I32, _P, _I64, _I64, _I64, _P, _I32, _P, _I64],
        "hm_isa_supported": [ctypes.c_char_p],
    }.items():
        getattr(_LIB, _name).argtypes, getattr(_LIB, _name).restype = _args, _I32

ISAS = {"scalar": 0, "avx2": 1, "avx512": 2}

# type -> byte offsets of its fp16 scale fields within a block
F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "IQ4_NL": [0], "IQ4_XS": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}


def _isa_params():
    out = []
    for name in ISAS:
        ok = _LIB is not None and _LIB.hm_isa_supported(name.encode())
        marks = [] if ok else [pytest.mark.skip(reason=f"this CPU lacks the instructions of the {name} kernels")]
        out.append(pytest.param(name, marks=marks, id=name))
    return out


def _qtype(name: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[name]


def _ks(name: str) -> list[int]:
    block = gguf.GGML_QUANT_SIZES[_qtype(name)][0]
    return [2880, 64] if block == 32 else [4096, 512, 256]


def random_rows(rng, name: str, rows: int, k: int, pad: int = 0) -> np.ndarray:
    """Random bytes, with every fp16 scale overwritten by a random finite fp16 (any sign and
    exponent, subnormals and zeros included). pad extra bytes at the end of each row."""
    block, size = gguf.GGML_QUANT_SIZES[_qtype(name)]
    nb = k // block
    raw = rng.integers(0, 256, size=(rows, nb, size), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        bits = rng.integers(0, 1 << 16, size=(rows, nb), dtype=np.uint16)
        bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0xBFFF, bits)  # exponent 31 -> 15: finite
        raw[:, :, off:off + 2] = bits.astype("<u2").view(np.uint8).reshape(rows, nb, 2)
    raw = raw.reshape(rows, nb * size)
    if pad:
        raw = np.concatenate([raw, rng.integers(0, 256, size=(rows, pad), dtype=np.uint8)], axis=1)
    return np.ascontiguousarray(raw)


def reference(raw: np.ndarray, name: str, k: int) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[_qtype(name)]
    with np.errstate(invalid="ignore", over="ignore"):
        return gguf.quants.dequantize(np.ascontiguousarray(raw[:, : k // block * size]), _qtype(name))


def decode(isa: str, name: str, raw: np.ndarray, k: int) -> np.ndarray:
    out = np.full((raw.shape[0] + 1, k), -7.0, dtype=np.float32)  # one guard row
    rc = _LIB.hm_ext_decode(ISAS[isa], int(_qtype(name)), raw.ctypes.data, raw.shape[1], raw.shape[0], k,
                            out.ctypes.data)
    assert rc == 0
    assert (out[-1] == -7.0).all()  # nothing written past n_rows * K
    return out[:-1]


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    """Equal float32 bits, except that any NaN matches any NaN."""
    assert got.shape == want.shape and got.dtype == want.dtype == np.float32
    nan_g, nan_w = np.isnan(got), np.isnan(want)
    assert np.array_equal(nan_g, nan_w), f"NaN at {np.argwhere(nan_g != nan_w)[:5].tolist()}"
    bad = (got.view(np.uint32) != want.view(np.uint32)) & ~nan_w
    assert not bad.any(), f"{bad.sum()} values differ, first at {np.argwhere(bad)[:3].tolist()}: " \
                          f"{got[bad][:3].tolist()} vs {want[bad][:3].tolist()}"


@pytest.mark.parametrize("name", list(F16_FIELDS))
@pytest.mark.parametrize("isa", _isa_params())
def test_decode_bit_exact(isa, name):
    rng = np.random.default_rng(sum(map(ord, name + isa)))
    for k in _ks(name):
        raw = random_rows(rng, name, 5, k)
        want = reference(raw, name, k)
        assert np.isfinite(want).all()
        got = decode(isa, name, raw, k)
        assert not np.isnan(got).any()
        assert_same_bits(got, want)


@pytest.mark.parametrize("name", list(F16_FIELDS))
@pytest.mark.parametrize("isa", _isa_params())
def test_decode_row_stride(isa, name):
    """Rows further apart than their blocks (row_bytes > packed size): the padding is skipped."""
    rng = np.random.default_rng(7)
    k = _ks(name)[-1]
    raw = random_rows(rng, name, 3, k, pad=13)
    assert_same_bits(decode(isa, name, raw, k), reference(raw, name, k))


@pytest.mark.parametrize("name", list(F16_FIELDS))
@pytest.mark.parametrize("isa", _isa_params())
def test_decode_nan_inf_scales_propagate(isa, name):
    """Stored inf / NaN scales give NaN / inf exactly where numpy's does (inf * 0 = NaN, etc.)."""
    rng = np.random.default_rng(3)
    k = _ks(name)[-1]
    block, size = gguf.GGML_QUANT_SIZES[_qtype(name)]
    raw = random_rows(rng, name, 4, 2 * k)
    specials = [0x7C00, 0xFC00, 0x7E00, 0x7C01]  # +inf, -inf, quiet NaN, signalling NaN
    for i, off in enumerate(F16_FIELDS[name] * 2):  # some blocks of rows 0..3, one field each
        r, b = i % 4, (3 * i) % (2 * k // block)
        raw[r, b * size + off:b * size + off + 2] = np.array([specials[i % 4]], "<u2").view(np.uint8)
    want = reference(raw, name, 2 * k)
    assert np.isnan(want).any() or np.isinf(want).any()
    assert_same_bits(decode(isa, name, raw, 2 * k), want)


def gemv(isa: str, name: str, raw: np.ndarray, rows: int, k: int, x: np.ndarray, ldo: int) -> np.ndarray:
    """hm_ext_gemv over the first rows rows of raw; out is [nt, ldo] with guard values past rows."""
    nt = x.shape[0]
    out = np.full((nt, ldo), -7.0, dtype=np.float32)
    ptrs = (ctypes.c_void_p * nt)(*[x[t].ctypes.data for t in range(nt)])
    rc = _LIB.hm_ext_gemv(ISAS[isa], int(_qtype(name)), raw.ctypes.data, raw.shape[1], rows, k, ptrs, nt,
                          out.ctypes.data, ldo)
    assert rc == 0
    assert (out[:, rows:] == -7.0).all()  # nothing written past n_rows
    return out[:, :rows]


def assert_close_to_product(got: np.ndarray, w: np.ndarray, x: np.ndarray) -> None:
    w64, x64 = w.astype(np.float64), x.astype(np.float64)
    want, scale = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
    assert np.isfinite(got).all()
    err = np.abs(got - want)
    assert (err <= 1e-6 * scale).all(), f"worst relative error {(err / scale).max():.3g}"


@pytest.mark.parametrize("name", list(F16_FIELDS))
@pytest.mark.parametrize("isa", _isa_params())
def test_gemv(isa, name):
    """Every token count 1..8 on an odd row count, against float64 products of numpy's weights."""
    rng = np.random.default_rng(sum(map(ord, name + isa)) + 1)
    k, rows = _ks(name)[0], 7
    raw = random_rows(rng, name, rows, k)
    w = reference(raw, name, k)
    for nt in range(1, 9):
        x = rng.standard_normal((nt, k), dtype=np.float32)
        assert_close_to_product(gemv(isa, name, raw, rows, k, x, rows + 3), w, x)


@pytest.mark.parametrize("name", list(F16_FIELDS))
@pytest.mark.parametrize("isa", _isa_params())
def test_gemv_shapes(isa, name):
    """One block per row, an odd block count, rows further apart than their blocks, one row, and
    (5 tokens at a large K: the K-chunked pass) more rows than one row group."""
    rng = np.random.default_rng(5)
    block = gguf.GGML_QUANT_SIZES[_qtype(name)][0]
    shapes = [(block, 5, 0), (3 * block, 3, 13), (_ks(name)[-1], 1, 0), (5 * block, 9, 1), (_ks(name)[0], 19, 7)]
    for k, rows, pad in shapes:
        raw = random_rows(rng, name, rows, k, pad=pad)
        w = reference(raw, name, k)
        for nt in (1, 2, 5):
            x = rng.standard_normal((nt, k), dtype=np.float32)
            assert_close_to_product(gemv(isa, name, raw, rows, k, x, rows), w, x)


@pytest.mark.parametrize("name", list(F16_FIELDS))
@pytest.mark.parametrize("isa", _isa_params())
def test_gemv_nan_only_from_weights(isa, name):
    """A row whose weights hold a NaN (a NaN block scale) gives NaN; every other row stays finite."""
    rng = np.random.default_rng(9)
    k, rows = _ks(name)[-1], 5
    block, size = gguf.GGML_QUANT_SIZES[_qtype(name)]
    raw = random_rows(rng, name, rows, k)
    off = F16_FIELDS[name][0]
    at = (k // block - 1) * size + off  # row 2, last block: a NaN scale
    raw[2, at:at + 2] = np.array([0x7E00], "<u2").view(np.uint8)
    w = reference(raw, name, k)
    assert np.isnan(w[2]).any() and np.isfinite(np.delete(w, 2, axis=0)).all()
    for nt in (1, 3, 8):
        x = rng.standard_normal((nt, k), dtype=np.float32)
        out = gemv(isa, name, raw, rows, k, x, rows)
        assert np.isnan(out[:, 2]).all()
        keep = [r for r in range(rows) if r != 2]
        assert_close_to_product(out[:, keep], w[keep], x)


@pytest.mark.parametrize("isa", _isa_params())
def test_gemv_empty_rows_give_zero(isa):
    """K = 0: every dot is an empty sum, 0."""
    x = np.zeros((2, 1), dtype=np.float32)
    for name in ("Q4_0", "Q4_K"):
        assert (gemv(isa, name, np.zeros((3, 0), dtype=np.uint8), 3, 0, x, 3) == 0).all()


def test_bad_arguments():
    buf = np.zeros(4096, dtype=np.uint8)
    out = np.zeros(4096, dtype=np.float32)
    x = np.zeros(64, dtype=np.float32)
    ptrs = (ctypes.c_void_p * 1)(x.ctypes.data)
    assert _LIB.hm_ext_decode(0, 8, buf.ctypes.data, 34, 1, 32, out.ctypes.data) == -1  # Q8_0: not an ext format
    assert _LIB.hm_ext_decode(0, 12, buf.ctypes.data, 144, 1, 128, out.ctypes.data) == -1  # K not a block multiple
    assert _LIB.hm_ext_decode(0, 2, buf.ctypes.data, 17, 1, 32, out.ctypes.data) == -1  # row shorter than its block
    assert _LIB.hm_ext_decode(5, 2, buf.ctypes.data, 18, 1, 32, out.ctypes.data) == -3  # no such ISA
    gemv = _LIB.hm_ext_gemv
    assert gemv(0, 2, buf.ctypes.data, 18, 1, 48, ptrs, 1, out.ctypes.data, 1) == -1  # K not a block multiple
    assert gemv(0, 2, buf.ctypes.data, 18, 1, 32, ptrs, 0, out.ctypes.data, 1) == -1  # nt < 1
    assert gemv(0, 2, buf.ctypes.data, 18, 1, 32, ptrs, 9, out.ctypes.data, 1) == -1  # nt > 8
    assert gemv(0, 2, buf.ctypes.data, 18, 2, 32, ptrs, 1, out.ctypes.data, 1) == -1  # ldo < n_rows
    assert gemv(5, 2, buf.ctypes.data, 18, 1, 32, ptrs, 1, out.ctypes.data, 1) == -3  # no such ISA
