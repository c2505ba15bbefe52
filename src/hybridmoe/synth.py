"""Synthetic gpt-oss GGUF files: real layouts, random seeded weights with sane scales.

Presets `20b` and `120b` match the released models' shapes, and by default their tensor types too
(experts MXFP4; attention, embedding and head Q8_0; norms, biases, sinks and router F32), so byte
counts, load paths and kernel speeds are those of the real files. `ftype` picks another published
type mix (llama-quantize's rules, quant_mix.py), `quantized_experts` a fine-tune's (experts
quantized too). `--sparse` writes only the header and leaves the data region as a hole (a 63 GB
120b-shaped file costs no disk).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import numpy as np

from hybridmoe.gguf.constants import BLOCK_SIZES, GGMLType
from hybridmoe.gguf.writer import TensorSpec, write_gguf
from hybridmoe.gpt_oss_config import (
    ARCH,
    DEFAULT_YARN_BETA_FAST,
    DEFAULT_YARN_BETA_SLOW,
    GptOssConfig,
)
from hybridmoe.quant_mix import DEFAULT_FTYPE, file_type_number, ftype_name, type_for



@dataclass(frozen=True)
class Preset:
    """A synthetic model: its shape as the loader reads it back, plus what only synth chooses."""

    config: GptOssConfig
    name: str  # general.name


# The released models' shape (docs/gpt-oss.md); the 120b differs in layers and experts only.
_GPT_OSS_20B = GptOssConfig(
    n_layers=24, hidden=2880, n_heads=64, n_kv_heads=8, head_dim=64, n_experts=32, n_experts_used=4,
    expert_ffn=2880, vocab_size=201088, context_length=131072, sliding_window=128, rms_eps=1e-5,
    rope_theta=150000.0, rope_scaling_factor=32.0, rope_original_ctx=4096,
    yarn_beta_fast=DEFAULT_YARN_BETA_FAST, yarn_beta_slow=DEFAULT_YARN_BETA_SLOW,
)

PRESETS: dict[str, Preset] = {
    # Tiny: every structural feature (GQA groups of 4, both layer kinds, 8 experts, YaRN) at
    # shapes that run in milliseconds. The small window lets short tests cross it.
    "tiny": Preset(replace(_GPT_OSS_20B, n_layers=4, hidden=64, n_heads=8, n_kv_heads=2, head_dim=16,
                           n_experts=8, n_experts_used=2, expert_ffn=64, vocab_size=1024,
                           context_length=4096, sliding_window=16),
                   "Synthetic gpt-oss tiny"),
    # Tiny with heads * head_dim = 256, so attn_output's rows hold a 256-element-block K-quant as
    # the real 4096 do (every other row is 64 wide and falls back, as 2880 does), and 16 experts
    # (llama-quantize has special cases for exactly 8): every ftype then has the published files'
    # type mix at tiny cost, and llama-quantize agrees with quant_mix tensor by tensor.
    "tiny256": Preset(replace(_GPT_OSS_20B, n_layers=4, hidden=64, n_heads=8, n_kv_heads=2, head_dim=32,
                              n_experts=16, n_experts_used=4, expert_ffn=64, vocab_size=1024,
                              context_length=4096, sliding_window=16),
                      "Synthetic gpt-oss tiny256"),
    "20b": Preset(_GPT_OSS_20B, "Synthetic gpt-oss 20b"),
    "120b": Preset(replace(_GPT_OSS_20B, n_layers=36, n_experts=128), "Synthetic gpt-oss 120b"),
}

_CHUNK_ROWS_BYTES = 64 << 20  # generate at most ~64 MiB at a time: bounded RAM for 12 GB files


def _rng_stream(seed: int, key: str) -> np.random.Generator:
    # Independent per-tensor streams: a tensor's values do not depend on which others exist.
    h = int.from_bytes(key.encode()[:32].ljust(32, b"\0"), "little") % (2**63)
    return np.random.default_rng([seed, h])


def _random_blocks(rng: np.random.Generator, t: GGMLType, n_rows: int, row_elems: int, std: float) -> np.ndarray:
    """Random raw rows of type t whose values have roughly standard deviation `std`."""
    be, bb = BLOCK_SIZES[t]
    nblk = row_elems // be
    if t == GGMLType.MXFP4:
        out = rng.integers(0, 256, size=(n_rows, nblk, bb), dtype=np.uint8)
        # Uniform E2M1 codes have RMS ~3.2 (in units of the scale); pick the exponent for `std`.
        e = int(round(127 + np.log2(std / 3.2)))
        out[:, :, 0] = np.uint8(e)
        return out.reshape(n_rows, nblk * bb)
    if t == GGMLType.Q8_0:
        out = np.empty((n_rows, nblk, bb), dtype=np.uint8)
        d = np.float16(std * np.sqrt(3.0) / 127.0)  # uniform int8 has RMS 127/sqrt(3)
        out[:, :, 0:2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
        out[:, :, 2:] = rng.integers(-127, 128, size=(n_rows, nblk, be), dtype=np.int8).view(np.uint8)
        return out.reshape(n_rows, nblk * bb)
    if t == GGMLType.F32:
        return rng.normal(0.0, std, size=(n_rows, row_elems)).astype(np.float32)
    if t == GGMLType.F16:
        return (rng.standard_normal(size=(n_rows, row_elems), dtype=np.float32) * np.float32(std)).astype(np.float16)
    if t in _BLOCK_MAKERS:
        return _BLOCK_MAKERS[t](rng, n_rows * nblk, std).reshape(n_rows, nblk * bb)
    raise ValueError(f"synthetic weights of type {t.name} are not supported")


# Random blocks of the other quantized types (layouts as gguf-py's quants.py decodes them). Codes
# are uniform random bits; scales are set so the values have the requested RMS and mean ~0:
# symmetric types get a random sign per block (or per sub-block), affine ones a min of -mean.

IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float64)


def _code_rms(bits: int, zero: int) -> float:
    """RMS of (q - zero) over uniform q in 0..2**bits-1."""
    return float(np.sqrt(np.mean((np.arange(2**bits) - zero) ** 2.0)))


def _code_std(bits: int) -> float:
    """Standard deviation of uniform q in 0..2**bits-1 (the affine types subtract the mean)."""
    return float(np.arange(2**bits).std())


def _f16(x: np.ndarray) -> np.ndarray:
    """(n,) floats -> (n, 2) fp16 bytes."""
    return np.asarray(x, dtype=np.float32).astype(np.float16).view(np.uint8).reshape(-1, 2)


def _jitter(rng: np.random.Generator, nb: int) -> np.ndarray:
    """Per-block scale factors with mean square 1: unequal block scales catch a kernel that reads
    the wrong block's scale."""
    return rng.uniform(0.5, 1.5, nb) / np.sqrt(13.0 / 12.0)


def _sign(rng: np.random.Generator, shape: int | tuple[int, ...]) -> np.ndarray:
    return np.where(rng.integers(0, 2, size=shape, dtype=np.uint8) == 1, -1, 1)


def _rms(x: np.ndarray) -> np.ndarray:
    """RMS over the sub-block axis: (nb, k) -> (nb,)."""
    return np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=1))


def _q_simple(t: GGMLType, code_rms: float) -> Callable[[np.random.Generator, int, float], np.ndarray]:
    """Q4_0, Q5_0, IQ4_NL: fp16 d, then code bits; value = d * code. d's random sign centres the
    codes' slightly negative mean."""

    def make(rng: np.random.Generator, nb: int, std: float) -> np.ndarray:
        out = rng.integers(0, 256, size=(nb, BLOCK_SIZES[t][1]), dtype=np.uint8)
        out[:, 0:2] = _f16(std / code_rms * _jitter(rng, nb) * _sign(rng, nb))
        return out

    return make


def _q_affine(t: GGMLType, bits: int) -> Callable[[np.random.Generator, int, float], np.ndarray]:
    """Q4_1, Q5_1: fp16 d, fp16 m, then code bits; value = d * q + m with m = -d * mean(q)."""

    def make(rng: np.random.Generator, nb: int, std: float) -> np.ndarray:
        out = rng.integers(0, 256, size=(nb, BLOCK_SIZES[t][1]), dtype=np.uint8)
        d = std / _code_std(bits) * _jitter(rng, nb)
        out[:, 0:2] = _f16(d)
        out[:, 2:4] = _f16(-d * (2**bits - 1) / 2)
        return out

    return make


def _q2_k(rng: np.random.Generator, nb: int, std: float) -> np.ndarray:
    """256 values in 16 groups: 4-bit scale and min per group, 2-bit codes, fp16 d and dmin.
    value = d*sc*q - dmin*m; min = scale and dmin = 1.5 d centre the codes 0..3."""
    out = rng.integers(0, 256, size=(nb, 84), dtype=np.uint8)
    sc = rng.integers(4, 16, size=(nb, 16), dtype=np.uint8)
    out[:, 0:16] = sc | (sc << 4)
    d = std / (_code_std(2) * _rms(sc)) * _jitter(rng, nb)
    out[:, 80:82] = _f16(d)
    out[:, 82:84] = _f16(1.5 * d)
    return out


def _signed_scales(rng: np.random.Generator, nb: int, k: int, lo: int, hi: int) -> np.ndarray:
    """(nb, k) sub-block scales of magnitude lo..hi and random sign (centres the codes' mean)."""
    return rng.integers(lo, hi + 1, size=(nb, k)) * _sign(rng, (nb, k))


def _q3_k(rng: np.random.Generator, nb: int, std: float) -> np.ndarray:
    """256 values in 16 groups: high-bit mask, 2-bit codes (codes -4..3), 6-bit signed scales
    packed in 12 bytes, fp16 d. value = d * (scale - 32) * code."""
    out = rng.integers(0, 256, size=(nb, 110), dtype=np.uint8)
    s = _signed_scales(rng, nb, 16, 8, 31)
    u = (s + 32).astype(np.uint8)
    out[:, 96:104] = (u[:, 0:8] & 0xF) | ((u[:, 8:16] & 0xF) << 4)
    hi = (u >> 4) & 3  # scale j's top two bits go to byte 8 + j % 4, bits 2 * (j // 4)
    out[:, 104:108] = hi[:, 0:4] | (hi[:, 4:8] << 2) | (hi[:, 8:12] << 4) | (hi[:, 12:16] << 6)
    out[:, 108:110] = _f16(std / (_code_rms(3, 4) * _rms(s)) * _jitter(rng, nb))
    return out


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins -> the 12 bytes of Q4_K/Q5_K: low six bits of the first four
    in bytes 0-7, the last four's low nibbles in bytes 8-11 and top bits in bytes 0-7's top bits."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    return out


def _q45_k(bits: int) -> Callable[[np.random.Generator, int, float], np.ndarray]:
    """Q4_K, Q5_K: fp16 d and dmin, 8 groups of 32 with 6-bit scale and min, then code bits.
    value = d*sc*q - dmin*m; min = scale and dmin = d * mean(q) centre the codes."""
    t = GGMLType.Q4_K if bits == 4 else GGMLType.Q5_K

    def make(rng: np.random.Generator, nb: int, std: float) -> np.ndarray:
        out = rng.integers(0, 256, size=(nb, BLOCK_SIZES[t][1]), dtype=np.uint8)
        sc = rng.integers(16, 64, size=(nb, 8), dtype=np.uint8)
        d = std / (_code_std(bits) * _rms(sc)) * _jitter(rng, nb)
        out[:, 0:2] = _f16(d)
        out[:, 2:4] = _f16(d * (2**bits - 1) / 2)
        out[:, 4:16] = _pack_k_scales(sc, sc)
        return out

    return make


def _q6_k(rng: np.random.Generator, nb: int, std: float) -> np.ndarray:
    """256 values: 4+2 code bits (codes -32..31), 16 int8 scales, fp16 d. value = d * scale * code."""
    out = rng.integers(0, 256, size=(nb, 210), dtype=np.uint8)
    s = _signed_scales(rng, nb, 16, 16, 127)
    out[:, 192:208] = s.astype(np.int8).view(np.uint8)
    out[:, 208:210] = _f16(std / (_code_rms(6, 32) * _rms(s)) * _jitter(rng, nb))
    return out


def _iq4_xs(rng: np.random.Generator, nb: int, std: float) -> np.ndarray:
    """256 values in 8 groups: fp16 d, 6-bit signed group scales (2 high bits in a uint16, low
    nibbles in 4 bytes), 4-bit indices into the IQ4_NL table. value = d * (scale - 32) * table[i]."""
    out = rng.integers(0, 256, size=(nb, 136), dtype=np.uint8)
    s = _signed_scales(rng, nb, 8, 8, 31)
    u = (s + 32).astype(np.uint16)
    high = np.zeros(nb, dtype=np.uint16)
    for j in range(8):
        high |= ((u[:, j] >> 4) & 3) << (2 * j)
    out[:, 0:2] = _f16(std / (np.sqrt(np.mean(IQ4_NL_VALUES**2)) * _rms(s)) * _jitter(rng, nb))
    out[:, 2:4] = high.astype("<u2").view(np.uint8).reshape(nb, 2)
    low = (u & 0xF).astype(np.uint8)
    out[:, 4:8] = low[:, 0::2] | (low[:, 1::2] << 4)
    return out


_BLOCK_MAKERS: dict[GGMLType, Callable[[np.random.Generator, int, float], np.ndarray]] = {
    GGMLType.Q4_0: _q_simple(GGMLType.Q4_0, _code_rms(4, 8)),
    GGMLType.Q5_0: _q_simple(GGMLType.Q5_0, _code_rms(5, 16)),
    GGMLType.IQ4_NL: _q_simple(GGMLType.IQ4_NL, float(np.sqrt(np.mean(IQ4_NL_VALUES**2)))),
    GGMLType.Q4_1: _q_affine(GGMLType.Q4_1, 4),
    GGMLType.Q5_1: _q_affine(GGMLType.Q5_1, 5),
    GGMLType.Q2_K: _q2_k,
    GGMLType.Q3_K: _q3_k,
    GGMLType.Q4_K: _q45_k(4),
    GGMLType.Q5_K: _q45_k(5),
    GGMLType.Q6_K: _q6_k,
    GGMLType.IQ4_XS: _iq4_xs,
}

# Every type a synthetic file may hold (tests check each decodes to the requested spread).
SYNTH_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.Q8_0, GGMLType.MXFP4, *_BLOCK_MAKERS)


def _tensor(
    name: str, t: GGMLType, ne: tuple[int, ...], seed: int, std: float, sparse: bool, mean: float = 0.0
) -> TensorSpec:
    if sparse:
        return TensorSpec(name, t, ne, None)
    row_elems = ne[0]
    n_rows = int(np.prod(ne[1:])) if len(ne) > 1 else 1
    be, bb = BLOCK_SIZES[t]
    row_bytes = row_elems // be * bb
    rows_per_chunk = max(1, _CHUNK_ROWS_BYTES // row_bytes)

    def chunks() -> Iterator[bytes]:
        rng = _rng_stream(seed, name)
        for r0 in range(0, n_rows, rows_per_chunk):
            n = min(rows_per_chunk, n_rows - r0)
            block = _random_blocks(rng, t, n, row_elems, std)
            if mean and t == GGMLType.F32:
                block = block + np.float32(mean)
            yield block.tobytes()

    return TensorSpec(name, t, ne, chunks)


def synth_tensors(p: Preset, seed: int, sparse: bool, ftype: str = DEFAULT_FTYPE,
                  quantized_experts: bool = False) -> list[TensorSpec]:
    """Every tensor of a gpt-oss GGUF of the preset's shape, in llama.cpp's names and order, each of
    the type an `ftype` file has (quant_mix.type_for)."""
    c = p.config
    H, D, E, I, V = c.hidden, c.head_dim, c.n_experts, c.expert_ffn, c.vocab_size
    q, kv = c.n_heads * D, c.n_kv_heads * D
    ftype = ftype_name(ftype)
    w = 1.0 / np.sqrt(H)  # keeps activations O(1) through the random layers

    def t(name: str, ne: tuple[int, ...], std: float, mean: float = 0.0) -> TensorSpec:
        gtype = type_for(name, ne, c.n_layers, ftype, quantized_experts)
        return _tensor(name, gtype, ne, seed, std, sparse, mean)

    specs = [t("token_embd.weight", (H, V), 1.0)]
    for i in range(c.n_layers):
        b = f"blk.{i}."
        specs += [
            t(b + "attn_norm.weight", (H,), 0.05, mean=1.0),
            t(b + "attn_q.weight", (H, q), w),
            t(b + "attn_q.bias", (q,), 0.02),
            t(b + "attn_k.weight", (H, kv), w),
            t(b + "attn_k.bias", (kv,), 0.02),
            t(b + "attn_v.weight", (H, kv), w),
            t(b + "attn_v.bias", (kv,), 0.02),
            t(b + "attn_output.weight", (q, H), 1.0 / np.sqrt(q)),
            t(b + "attn_output.bias", (H,), 0.02),
            t(b + "attn_sinks.weight", (c.n_heads,), 1.0),
            t(b + "post_attention_norm.weight", (H,), 0.05, mean=1.0),
            t(b + "ffn_gate_inp.weight", (H, E), w),
            t(b + "ffn_gate_inp.bias", (E,), 0.1),
            t(b + "ffn_gate_exps.weight", (H, I, E), w),
            t(b + "ffn_gate_exps.bias", (I, E), 0.02),
            t(b + "ffn_up_exps.weight", (H, I, E), w),
            t(b + "ffn_up_exps.bias", (I, E), 0.02),
            t(b + "ffn_down_exps.weight", (I, H, E), 1.0 / np.sqrt(I)),
            t(b + "ffn_down_exps.bias", (H, E), 0.02),
        ]
    specs += [
        t("output_norm.weight", (H,), 0.05, mean=1.0),
        t("output.weight", (H, V), w * 4),
    ]
    return specs


def synth_metadata(p: Preset, seed: int, ftype: str = DEFAULT_FTYPE) -> dict:
    """The file's metadata: general.*, the config's own keys, then the synthetic vocabulary."""
    from hybridmoe.tokenizer.synthetic import make_vocab

    meta = {
        "general.architecture": ARCH,
        "general.type": "model",
        "general.name": p.name,
        "general.description": "random weights written by `hybridmoe synth`; not a trained model",
        "general.file_type": file_type_number(ftype),
        "general.quantization_version": 2,
        **p.config.to_metadata(),
    }
    vocab = p.config.vocab_size
    meta.update(make_vocab(vocab, seed, "20b" if vocab == _GPT_OSS_20B.vocab_size else "tiny"))
    return meta


def write_synthetic(
    path: str | os.PathLike,
    preset: str = "tiny",
    *,
    seed: int = 0,
    n_layers: int | None = None,
    sparse: bool = False,
    ftype: str = DEFAULT_FTYPE,
    quantized_experts: bool = False,
    progress: Callable[[int], None] | None = None,
) -> str:
    """Write a synthetic gpt-oss GGUF with `ftype`'s tensor types (quant_mix); returns the path."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    p = PRESETS[preset]
    if n_layers is not None:
        if n_layers < 1:
            raise ValueError("--layers must be at least 1")
        p = replace(p, config=replace(p.config, n_layers=n_layers))
    ftype = ftype_name(ftype)
    write_gguf(path, synth_metadata(p, seed, ftype), synth_tensors(p, seed, sparse, ftype, quantized_experts),
               sparse=sparse)
    return str(path)
