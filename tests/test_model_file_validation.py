"""Damaged model files: every metadata value the model uses is checked before anything is sized
from it, and `serve` says what is wrong in one line (file, key, value) with a non-zero exit."""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from hybridmoe.gguf.errors import GGUFError
from hybridmoe.gguf.reader import open_model
from hybridmoe.gguf.writer import write_gguf
from hybridmoe.gpt_oss_config import GptOssConfig
from hybridmoe.placement.memory import fit_context, kv_cache_bytes
from hybridmoe.synth import PRESETS, synth_metadata, synth_tensors
from tests.damaged_files import NEW_TYPES, TARGET, T, cli_fails, model_with

# (key, bad value, words the message must hold besides file, key and value)
BAD_VALUES = [
    ("gpt-oss.attention.head_count", 0, "at least 1"),
    ("gpt-oss.attention.head_count_kv", 0, "at least 1"),
    ("gpt-oss.attention.layer_norm_rms_epsilon", float("nan"), "finite"),
    ("gpt-oss.attention.layer_norm_rms_epsilon", -1e-5, "greater than 0"),
    ("gpt-oss.rope.freq_base", 0.0, "greater than 1"),
    ("gpt-oss.rope.freq_base", float("inf"), "finite"),
    ("gpt-oss.attention.sliding_window", 0, "at least 1"),
    ("gpt-oss.block_count", 0, "at least 1"),
    ("gpt-oss.embedding_length", 2**40, "at most"),
    ("gpt-oss.expert_used_count", 1000, "at most"),
    ("gpt-oss.context_length", "long", "integer"),
]


def _write(path: Path, key: str | None = None, value: object = None) -> str:
    p = PRESETS["tiny"]
    meta = synth_metadata(p, 0)
    if key is not None:
        meta[key] = value
    write_gguf(path, meta, synth_tensors(p, 0, sparse=False))
    return str(path)


@pytest.mark.parametrize("key,value,why", BAD_VALUES)
def test_bad_metadata_value_names_file_key_and_value(tmp_path: Path, key: str, value: object, why: str):
    path = _write(tmp_path / "bad.gguf", key, value)
    mf = open_model(path)
    with pytest.raises(GGUFError) as e:
        GptOssConfig.from_metadata(mf.metadata, mf.path)
    msg = str(e.value)
    shown = repr(mf.metadata[key])
    assert msg.startswith(path) and key in msg and shown in msg and why in msg, msg


def test_metadata_arrays_nested_too_deep(tmp_path: Path):
    value = struct.pack("<IQ", 5, 0)  # innermost: an empty int32 array
    for _ in range(5000):
        value = struct.pack("<IQ", 9, 1) + value  # ARRAY of one ARRAY
    key = b"deep.key"
    data = (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
            + struct.pack("<I", 9) + value)
    path = tmp_path / "deep.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFError, match=r"deep\.gguf: metadata 'deep\.key'\[0\].*nested 17 deep"):
        open_model(path)


def test_overlapping_tensors(tmp_path: Path):
    path = Path(_write(tmp_path / "overlap.gguf"))
    mf = open_model(path)
    name = "blk.0.attn_q.bias"
    rel = mf.tensors[name].offset - mf.files[0].data_offset
    n_dims = len(mf.tensors[name].ne)
    mf.close()
    data = bytearray(path.read_bytes())
    at = data.index(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name) + 4 + 8 * n_dims + 4
    assert struct.unpack_from("<Q", data, at)[0] == rel
    struct.pack_into("<Q", data, at, 0)  # the data of the first tensor
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"overlap\.gguf: tensor '.*': offset = 0 overlaps tensor") as e:
        open_model(path)
    assert name in str(e.value) and "token_embd.weight" in str(e.value)


def test_non_regular_files_are_named_as_such(tmp_path: Path):
    d = tmp_path / "dir.gguf"
    d.mkdir()
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    for path, kind in ((d, "a directory"), (fifo, "a named pipe"), (Path("/dev/zero"), "a character device")):
        with pytest.raises(GGUFError, match=f"{path}: is {kind}"):
            open_model(path)


def test_model_context_is_capped_to_memory_and_explicit_c_refused():
    cfg = GptOssConfig(n_layers=4, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=4,
                       n_experts_used=2, expert_ffn=64, vocab_size=100, context_length=4294967295,
                       sliding_window=128, rms_eps=1e-5, rope_theta=1e4, rope_scaling_factor=1.0,
                       rope_original_ctx=4096, yarn_beta_fast=32.0, yarn_beta_slow=1.0)
    available = 1 << 30
    fit = fit_context(cfg, 0, 4, 4, available)
    assert fit.note is not None and "-c N" in fit.note and "4294967295" in fit.note
    assert fit.ctx_size % (256 * 4) == 0 and fit.ctx_size > 0
    assert kv_cache_bytes(cfg, fit.ctx_size, 4, 4) <= available // 2 < kv_cache_bytes(cfg, fit.ctx_size + 1024, 4, 4)
    assert fit_context(cfg, 8192, 4, 4, available).ctx_size == 8192  # explicit and fits: as asked
    with pytest.raises(ValueError, match=r"-c 100000000 needs .* GiB of KV cache"):
        fit_context(cfg, 100_000_000, 4, 4, available)


def _serve_fails(path: str) -> list[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "hybridmoe.cli", "serve", "-m", path, "--port", "0"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode not in (0, 134, -6), (p.returncode, p.stderr)
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines


@pytest.mark.parametrize("key,value,_why", BAD_VALUES[:3] + BAD_VALUES[4:5])
def test_serve_on_a_damaged_file_is_one_line(tmp_path: Path, key: str, value: object, _why: str):
    path = _write(tmp_path / "bad.gguf", key, value)
    [line] = _serve_fails(path)
    shown = "nan" if isinstance(value, float) and math.isnan(value) else repr(value)
    assert path in line and key in line and shown in line, line


def test_serve_on_a_directory_is_one_line(tmp_path: Path):
    [line] = _serve_fails(str(tmp_path))
    assert str(tmp_path) in line and "directory" in line


def _truncated(tmp_path: Path, t: T) -> tuple[Path, str]:
    """A file whose last tensor (type t) lacks its final byte, and the reader's line for it."""
    path = tmp_path / f"{t.name}.gguf"
    info = model_with(path, t, last=True)
    end = info.offset + info.nbytes
    os.truncate(path, end - 1)
    return path, (f"{path}: truncated data: tensor '{TARGET}' ({t.name}, ne=[256, 64]) spans bytes "
                  f"{info.offset}..{end} but the file has {end - 1}")


@pytest.mark.parametrize("t", NEW_TYPES, ids=lambda t: t.name)
def test_serve_on_a_truncated_tensor_of_each_block_type_is_one_line(tmp_path: Path, t: T):
    path, expected = _truncated(tmp_path, t)
    assert cli_fails("serve", "-m", str(path), "--port", "0") == f"hybridmoe serve: error: {expected}"


def test_generate_on_a_truncated_tensor_is_one_line(tmp_path: Path):
    path, expected = _truncated(tmp_path, T.Q5_K)
    assert cli_fails("generate", "-m", str(path), "-n", "1") == f"hybridmoe generate: error: {expected}"
