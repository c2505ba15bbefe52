"""`--check-tensors`: every block scale and every float value of a model, checked finite before
the model is built, so a damaged file is refused in one line instead of serving NaN logits.

What is checked is what llama-server's check reads: the f16 scales of each block type (d, and
dmin / m where the type has one), MXFP4's E8M0 exponent (0xFF is E8M0's NaN code; ggml's check
refuses it too) and every F32 / F16 / BF16 value. Each test is one mask on the bits that make a
float inf or NaN (all exponent bits set), done with numpy over the memory-mapped tensors in chunks
of `CHUNK_BYTES`: bounded memory, no copy of the file, about the speed of reading it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from hybridmoe.gguf.constants import BLOCK_SIZES, GGMLType
from hybridmoe.gguf.errors import GGUFError
from hybridmoe.gguf.reader import ModelFile, TensorInfo
from hybridmoe.quant.block_types import F16_FIELDS

T = GGMLType
CHUNK_BYTES = 32 << 20  # per numpy pass: large enough to amortise the call, small enough for cache

# Float types: (unsigned view dtype, the exponent bits that are all set in an inf or a NaN).
_FLOAT_BITS: dict[GGMLType, tuple[type[np.unsignedinteger], int]] = {
    T.F32: (np.uint32, 0x7F800000), T.F16: (np.uint16, 0x7C00), T.BF16: (np.uint16, 0x7F80)}
_FLOAT_VIEWS = {T.F32: np.float32, T.F16: np.float16}
# The second f16 field's name where a type has two: an offset (m) or a scale of the mins (dmin).
_SECOND_FIELD = {T.Q4_1: "m", T.Q5_1: "m", T.Q2_K: "dmin", T.Q4_K: "dmin", T.Q5_K: "dmin"}


@dataclass(frozen=True)
class _Field:
    """One scale field of a block: its name in the message, where it is and the byte to test."""

    name: str
    at: int  # byte offset of the field in a block
    test_byte: int  # the byte that holds the field's exponent bits
    mask: int  # those bits; all set = inf / NaN


def _fields(t: GGMLType) -> tuple[_Field, ...]:
    """The scale fields of block type t: an f16's exponent is in its high byte (bits 2-6)."""
    if t == T.MXFP4:
        return (_Field("e", 0, 0, 0xFF),)
    offsets = (0,) if t == T.Q8_0 else F16_FIELDS[t]
    names = ("d", _SECOND_FIELD.get(t, ""))
    return tuple(_Field(names[i], at, at + 1, 0x7C) for i, at in enumerate(offsets))


CHECKED_TYPES = (*_FLOAT_BITS, T.Q8_0, T.MXFP4, *F16_FIELDS)


def _shown(t: GGMLType, field: _Field, block: np.ndarray) -> str:
    """The bad scale as the message shows it."""
    if t == T.MXFP4:
        return f"{int(block[field.at])} (the E8M0 NaN code)"
    return str(float(block[field.at:field.at + 2].view(np.float16)[0]))


def _first_set(tested: np.ndarray, mask: int, scratch: np.ndarray) -> int | None:
    """Index of the first element of `tested` with every bit of `mask` set, else None. The common
    all-clean case costs one masked copy and one max."""
    out = scratch[:tested.size]
    np.bitwise_and(tested, mask, out=out)
    if int(out.max(initial=0)) != mask:
        return None
    return int(np.flatnonzero(out == mask)[0])


def _check_blocks(path: str, info: TensorInfo, flat: np.ndarray, chunk_bytes: int) -> None:
    t = info.ggml_type
    be, bb = BLOCK_SIZES[t]
    per_row = (info.ne[0] if info.ne else 1) // be
    fields = _fields(t)
    step = max(1, chunk_bytes // bb)
    scratch = np.empty(min(step, flat.size // bb), dtype=np.uint8)
    for b0 in range(0, flat.size // bb, step):
        blocks = flat[b0 * bb:(b0 + step) * bb].reshape(-1, bb)
        hits = [(i, f) for f in fields if (i := _first_set(blocks[:, f.test_byte], f.mask, scratch)) is not None]
        if hits:
            i, f = min(hits, key=lambda h: h[0])
            row, block = divmod(b0 + i, per_row)
            raise GGUFError(f"{path}: tensor {info.name!r} ({t.name}): block {block} of row {row} has scale "
                            f"{f.name} = {_shown(t, f, blocks[i])}")


def _check_floats(path: str, info: TensorInfo, flat: np.ndarray, chunk_bytes: int) -> None:
    t = info.ggml_type
    udtype, mask = _FLOAT_BITS[t]
    values = flat.view(udtype)
    per_row = info.ne[0] if info.ne else 1
    step = max(1, chunk_bytes // values.itemsize)
    scratch = np.empty(min(step, values.size), dtype=udtype)
    for e0 in range(0, values.size, step):
        i = _first_set(values[e0:e0 + step], mask, scratch)
        if i is not None:
            row, element = divmod(e0 + i, per_row)
            raise GGUFError(f"{path}: tensor {info.name!r} ({t.name}): value {_float_value(t, values[e0 + i])} "
                            f"at element {element} of row {row}")


def _float_value(t: GGMLType, bits: np.unsignedinteger) -> str:
    if t == T.BF16:  # bf16 is the top half of an f32
        return str(float(np.array([int(bits) << 16], dtype=np.uint32).view(np.float32)[0]))
    return str(float(np.array([bits]).view(_FLOAT_VIEWS[t])[0]))


def check_tensor(model: ModelFile, name: str, chunk_bytes: int = CHUNK_BYTES) -> None:
    """GGUFError naming file, tensor and value if tensor `name` holds an inf/NaN scale or value;
    types this check does not know (none that the model reads) pass."""
    info = model.info(name)
    if info.ggml_type not in CHECKED_TYPES or not info.nbytes:
        return
    path = model.files[info.file_index].path
    flat = model.raw(name).reshape(-1)
    if info.ggml_type in _FLOAT_BITS:
        _check_floats(path, info, flat, chunk_bytes)
    else:
        _check_blocks(path, info, flat, chunk_bytes)


def check_tensors(model: ModelFile, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Check every tensor (in file order, so the file is read front to back); returns the bytes
    read. Raises GGUFError at the first bad scale or value."""
    order = sorted(model.tensors.values(), key=lambda i: (i.file_index, i.offset))
    for info in order:
        check_tensor(model, info.name, chunk_bytes)
    return sum(i.nbytes for i in order)


def check_tensors_logged(model: ModelFile, log: logging.Logger) -> None:
    """check_tensors for a command: a clean file logs what was read and how long it took (one line
    at INFO); a bad one raises, so the command's error line is all the user sees."""
    t0 = time.perf_counter()
    nbytes = check_tensors(model)
    log.info("--check-tensors: %d tensors, %.2f GiB checked in %.1f s: no inf or NaN", len(model.tensors),
             nbytes / 2**30, time.perf_counter() - t0)
