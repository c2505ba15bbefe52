"""Test helpers: small gpt-oss files holding a tensor of any type we read, to damage in one place.

Torch-free, so `serve` / `generate` subprocess tests on them stay fast.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from hybridmoe.gguf.constants import BLOCK_SIZES, GGMLType
from hybridmoe.gguf.reader import TensorInfo, open_model
from hybridmoe.gguf.writer import TensorSpec, write_gguf
from hybridmoe.quant import quantize
from hybridmoe.quant.block_types import TYPES as BLOCK_TYPES
from hybridmoe.synth import PRESETS, synth_metadata, synth_tensors

T = GGMLType
NEW_TYPES = BLOCK_TYPES  # Q4_0 Q4_1 Q5_0 Q5_1 IQ4_NL IQ4_XS Q2_K Q3_K Q4_K Q5_K Q6_K
ALL_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.MXFP4, *NEW_TYPES)
# tiny256's attn_output: rows of 256, which every block type divides
TARGET = "blk.1.attn_output.weight"


def model_with(path: Path, t: GGMLType, last: bool = False) -> TensorInfo:
    """Write tiny256 (the synth default mix) with TARGET of type `t`, holding real quantized values;
    with `last` its data ends the file. Returns TARGET's info as the reader sees it."""
    p = PRESETS["tiny256"]
    specs = synth_tensors(p, 0, sparse=False)
    i = next(k for k, s in enumerate(specs) if s.name == TARGET)
    ne = tuple(specs[i].ne)
    x = np.random.default_rng(int(t)).normal(0, 0.05, size=(ne[1], ne[0])).astype(np.float32)
    spec = TensorSpec(TARGET, t, ne, quantize(x, t))
    specs = [*specs[:i], *specs[i + 1:], spec] if last else [*specs[:i], spec, *specs[i + 1:]]
    write_gguf(path, synth_metadata(p, 0), specs)
    with open_model(path) as mf:
        return mf.info(TARGET)


def patch(path: Path, at: int, data: bytes) -> None:
    """Overwrite bytes of the file at absolute offset `at`."""
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def block_offset(info: TensorInfo, row: int, block: int) -> int:
    """Absolute file offset of one block of a tensor."""
    be, bb = BLOCK_SIZES[info.ggml_type]
    return info.offset + (row * (info.ne[0] // be) + block) * bb


def cli_fails(*argv: str, env: dict[str, str] | None = None) -> str:
    """Run `hybridmoe ARGV`; it must exit non-zero (not abort) with exactly one line, returned."""
    p = subprocess.run([sys.executable, "-m", "hybridmoe.cli", *argv], capture_output=True, text=True,
                       timeout=60, env=env)
    assert p.returncode not in (0, 134, -6), (p.returncode, p.stderr)
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]
