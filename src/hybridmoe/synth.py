"""Synthetic gpt-oss GGUF files: real layouts, random seeded weights with sane scales.

Presets `20b` and `120b` match the released models' shapes and tensor types exactly (experts
MXFP4; attention, embedding and head Q8_0; norms, biases, sinks and router F32), so byte counts,
load paths and kernel speeds are those of the real files. `--sparse` writes only the header and
leaves the data region as a hole (a 63 GB 120b-shaped file costs no disk).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import numpy as np

from hybridmoe.gguf.constants import BLOCK_SIZES, GGMLType
from hybridmoe.gguf.writer import TensorSpec, write_gguf
from hybridmoe.models.gpt_oss_config import (
    ARCH,
    DEFAULT_YARN_BETA_FAST,
    DEFAULT_YARN_BETA_SLOW,
    GptOssConfig,
)



@dataclass(frozen=True)
class Preset:
    """A synthetic model: its shape as the loader reads it back, plus what only synth chooses."""

    config: GptOssConfig
    dense_type: GGMLType  # attention, embedding and output head weights (experts are MXFP4)
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
                   GGMLType.Q8_0, "Synthetic gpt-oss tiny"),
    "20b": Preset(_GPT_OSS_20B, GGMLType.Q8_0, "Synthetic gpt-oss 20b"),
    "120b": Preset(replace(_GPT_OSS_20B, n_layers=36, n_experts=128), GGMLType.Q8_0, "Synthetic gpt-oss 120b"),
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
    raise ValueError(f"synthetic weights of type {t.name} are not supported")


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


def synth_tensors(p: Preset, seed: int, sparse: bool) -> list[TensorSpec]:
    """Every tensor of a gpt-oss GGUF of the preset's shape, in llama.cpp's names and order."""
    c = p.config
    H, D, E, I, V = c.hidden, c.head_dim, c.n_experts, c.expert_ffn, c.vocab_size
    q, kv = c.n_heads * D, c.n_kv_heads * D
    F32 = GGMLType.F32
    w = 1.0 / np.sqrt(H)  # keeps activations O(1) through the random layers
    specs = [_tensor("token_embd.weight", p.dense_type, (H, V), seed, 1.0, sparse)]
    for i in range(c.n_layers):
        b = f"blk.{i}."
        specs += [
            _tensor(b + "attn_norm.weight", F32, (H,), seed, 0.05, sparse, mean=1.0),
            _tensor(b + "attn_q.weight", p.dense_type, (H, q), seed, w, sparse),
            _tensor(b + "attn_q.bias", F32, (q,), seed, 0.02, sparse),
            _tensor(b + "attn_k.weight", p.dense_type, (H, kv), seed, w, sparse),
            _tensor(b + "attn_k.bias", F32, (kv,), seed, 0.02, sparse),
            _tensor(b + "attn_v.weight", p.dense_type, (H, kv), seed, w, sparse),
            _tensor(b + "attn_v.bias", F32, (kv,), seed, 0.02, sparse),
            _tensor(b + "attn_output.weight", p.dense_type, (q, H), seed, 1.0 / np.sqrt(q), sparse),
            _tensor(b + "attn_output.bias", F32, (H,), seed, 0.02, sparse),
            _tensor(b + "attn_sinks.weight", F32, (c.n_heads,), seed, 1.0, sparse),
            _tensor(b + "post_attention_norm.weight", F32, (H,), seed, 0.05, sparse, mean=1.0),
            _tensor(b + "ffn_gate_inp.weight", F32, (H, E), seed, w, sparse),
            _tensor(b + "ffn_gate_inp.bias", F32, (E,), seed, 0.1, sparse),
            _tensor(b + "ffn_gate_exps.weight", GGMLType.MXFP4, (H, I, E), seed, w, sparse),
            _tensor(b + "ffn_gate_exps.bias", F32, (I, E), seed, 0.02, sparse),
            _tensor(b + "ffn_up_exps.weight", GGMLType.MXFP4, (H, I, E), seed, w, sparse),
            _tensor(b + "ffn_up_exps.bias", F32, (I, E), seed, 0.02, sparse),
            _tensor(b + "ffn_down_exps.weight", GGMLType.MXFP4, (I, H, E), seed, 1.0 / np.sqrt(I), sparse),
            _tensor(b + "ffn_down_exps.bias", F32, (H, E), seed, 0.02, sparse),
        ]
    specs += [
        _tensor("output_norm.weight", F32, (H,), seed, 0.05, sparse, mean=1.0),
        _tensor("output.weight", p.dense_type, (H, V), seed, w * 4, sparse),
    ]
    return specs


def synth_metadata(p: Preset, seed: int) -> dict:
    """The file's metadata: general.*, the config's own keys, then the synthetic vocabulary."""
    from hybridmoe.tokenizer.synthetic import make_vocab

    meta = {
        "general.architecture": ARCH,
        "general.type": "model",
        "general.name": p.name,
        "general.description": "random weights written by `hybridmoe synth`; not a trained model",
        "general.file_type": 38,
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
    progress: Callable[[int], None] | None = None,
) -> str:
    """Write a synthetic gpt-oss GGUF; returns the path."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    p = PRESETS[preset]
    if n_layers is not None:
        if n_layers < 1:
            raise ValueError("--layers must be at least 1")
        p = replace(p, config=replace(p.config, n_layers=n_layers))
    write_gguf(path, synth_metadata(p, seed), synth_tensors(p, seed, sparse), sparse=sparse)
    return str(path)
