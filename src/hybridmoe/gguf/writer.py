"""GGUF v3 writer: streams tensor data (bounded RAM) or leaves it as a sparse hole.

Metadata values are typed from their Python type (see `_infer_type`); an explicit
`(value, GGUFValueType)` tuple overrides it (for a list, the type given is the element type).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, Union

import numpy as np

from hybridmoe.gguf.constants import (
    BLOCK_SIZES,
    DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGUF_VERSION,
    MAX_DIMS,
    VALUE_DTYPES,
    GGMLType,
    GGUFValueType,
    Keys,
)

ChunkSource = Callable[[], Iterable[Union[bytes, bytearray, memoryview, np.ndarray]]]
_INT32 = (-(2**31), 2**31 - 1)
MAX_NAME_BYTES = 64  # ggml's GGML_MAX_NAME, NUL included


@dataclass
class TensorSpec:
    """One tensor to write. `data`: numpy array holding the raw bytes/values (its byte size must
    equal the tensor's), a callable returning an iterable of byte chunks, or None (sparse hole)."""

    name: str
    ggml_type: GGMLType
    ne: Sequence[int]  # ggml order, ne[0] innermost
    data: np.ndarray | ChunkSource | None = None

    @property
    def nbytes(self) -> int:
        be, bb = BLOCK_SIZES[GGMLType(self.ggml_type)]
        ne = [int(d) for d in self.ne]
        if not ne:
            return bb
        if ne[0] % be:
            raise ValueError(f"tensor {self.name!r}: ne[0] = {ne[0]} is not a multiple of the "
                             f"{GGMLType(self.ggml_type).name} block size {be}")
        n = ne[0] // be * bb
        for d in ne[1:]:
            n *= d
        return n


def _infer_type(key: str, v: Any) -> tuple[GGUFValueType, GGUFValueType | None]:
    """(value type, element type for arrays) from a Python/numpy value."""
    if isinstance(v, (bool, np.bool_)):
        return GGUFValueType.BOOL, None
    if isinstance(v, (int, np.integer)):
        v = int(v)
        if v < 0:
            if v < _INT32[0]:
                return GGUFValueType.INT64, None
            return GGUFValueType.INT32, None
        return (GGUFValueType.UINT32 if v < 2**32 else GGUFValueType.UINT64), None
    if isinstance(v, (float, np.floating)):
        return GGUFValueType.FLOAT32, None
    if isinstance(v, str):
        return GGUFValueType.STRING, None
    if isinstance(v, np.ndarray):
        if v.dtype.kind in "iu":
            return GGUFValueType.ARRAY, _int_array_type(v)
        if v.dtype.kind == "f":
            return GGUFValueType.ARRAY, GGUFValueType.FLOAT32
        if v.dtype.kind == "b":
            return GGUFValueType.ARRAY, GGUFValueType.BOOL
        v = v.tolist()
    if isinstance(v, (list, tuple)):
        if not v or all(isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))
                        for x in v):
            return GGUFValueType.ARRAY, _int_array_type(np.asarray(v, dtype=np.int64))
        if all(isinstance(x, str) for x in v):
            return GGUFValueType.ARRAY, GGUFValueType.STRING
        if all(isinstance(x, (bool, np.bool_)) for x in v):
            return GGUFValueType.ARRAY, GGUFValueType.BOOL
        if all(isinstance(x, (int, float, np.integer, np.floating)) for x in v):
            return GGUFValueType.ARRAY, GGUFValueType.FLOAT32
    raise TypeError(f"metadata {key!r}: cannot store a value of type {type(v).__name__} "
                    f"(use a (value, GGUFValueType) tuple or a list of one element type)")


def _int_array_type(a: np.ndarray) -> GGUFValueType:
    if a.size and (a.min() < _INT32[0] or a.max() > _INT32[1]):
        return GGUFValueType.INT64
    return GGUFValueType.INT32


def _encode_str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _encode_scalar(key: str, vt: GGUFValueType, v: Any) -> bytes:
    if vt == GGUFValueType.STRING:
        if not isinstance(v, str):
            raise TypeError(f"metadata {key!r}: STRING value must be a str, got {type(v).__name__}")
        return _encode_str(v)
    dt = np.dtype(VALUE_DTYPES[vt])
    if dt.kind in "iu":
        info = np.iinfo(dt)
        if not isinstance(v, (int, np.integer)) or not info.min <= int(v) <= info.max:
            raise ValueError(f"metadata {key!r}: value {v!r} does not fit {vt.name}")
    return np.asarray(v, dtype=dt).tobytes()


def _encode_array(key: str, et: GGUFValueType, v: Any) -> bytes:
    items = list(v) if not isinstance(v, np.ndarray) else v
    head = struct.pack("<IQ", et, len(items))
    if et == GGUFValueType.STRING:
        return head + b"".join(_encode_str(s) for s in items)
    if et == GGUFValueType.ARRAY:
        raise ValueError(f"metadata {key!r}: nested arrays are not supported by this writer")
    src = np.asarray(items)
    arr = src.astype(VALUE_DTYPES[et])
    if et not in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64) and src.size and \
            not np.array_equal(arr.astype(np.int64), src.astype(np.int64)):
        raise ValueError(f"metadata {key!r}: array values do not fit {et.name}")
    return head + arr.tobytes()


def encode_kv(key: str, value: Any) -> bytes:
    """One metadata record (key, type, value) in GGUF encoding."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], GGUFValueType):
        value, vt = value
        if isinstance(value, (list, tuple, np.ndarray)) and vt != GGUFValueType.ARRAY:
            vt, et = GGUFValueType.ARRAY, vt
        elif vt == GGUFValueType.ARRAY:
            et = _infer_type(key, value)[1]
        else:
            et = None
    else:
        vt, et = _infer_type(key, value)
    body = _encode_array(key, et, value) if vt == GGUFValueType.ARRAY else \
        _encode_scalar(key, vt, value)
    return _encode_str(key) + struct.pack("<I", vt) + body


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def header_and_offsets(metadata: dict[str, Any], tensors: Sequence[TensorSpec], alignment: int
            ) -> tuple[bytes, list[int]]:
    """Header bytes (padded to alignment) and each tensor's offset relative to the data start."""
    meta = dict(metadata)
    if alignment != DEFAULT_ALIGNMENT:
        meta.setdefault(Keys.ALIGNMENT, (alignment, GGUFValueType.UINT32))
    parts = [struct.pack("<IIQQ", GGUF_MAGIC, GGUF_VERSION, len(tensors), len(meta))]
    parts += [encode_kv(k, v) for k, v in meta.items()]
    offsets, off, seen = [], 0, set()
    for t in tensors:
        if t.name in seen:
            raise ValueError(f"duplicate tensor name {t.name!r}")
        seen.add(t.name)
        if len(t.ne) > MAX_DIMS:
            raise ValueError(f"tensor {t.name!r}: {len(t.ne)} dims > {MAX_DIMS}")
        name = t.name.encode("utf-8")
        if len(name) >= MAX_NAME_BYTES:
            raise ValueError(f"tensor {t.name!r}: name is {len(name)} bytes; llama.cpp allows "
                             f"at most {MAX_NAME_BYTES - 1}")
        parts.append(struct.pack("<Q", len(name)) + name + struct.pack("<I", len(t.ne)))
        parts.append(struct.pack(f"<{len(t.ne)}Q", *(int(d) for d in t.ne)))
        parts.append(struct.pack("<IQ", GGMLType(t.ggml_type), off))
        offsets.append(off)
        off = _align(off + t.nbytes, alignment)
    head = b"".join(parts)
    return head + b"\0" * (_align(len(head), alignment) - len(head)), offsets


def _write_data(f: BinaryIO, t: TensorSpec, sparse: bool) -> None:
    n = t.nbytes
    if t.data is None:
        if not sparse:
            raise ValueError(f"tensor {t.name!r}: no data (data=None needs sparse=True)")
        f.seek(n, os.SEEK_CUR)
        return
    if isinstance(t.data, np.ndarray):
        a = np.ascontiguousarray(t.data)
        if a.nbytes != n:
            raise ValueError(f"tensor {t.name!r}: data has {a.nbytes} bytes ({a.dtype}, "
                             f"{a.shape}), {GGMLType(t.ggml_type).name} ne={list(t.ne)} needs {n}")
        f.write(memoryview(a).cast("B"))
        return
    if not callable(t.data):
        raise TypeError(f"tensor {t.name!r}: data must be an ndarray, a callable or None")
    written = 0
    for chunk in t.data():
        mv = memoryview(np.ascontiguousarray(chunk) if isinstance(chunk, np.ndarray) else chunk)
        mv = mv.cast("B")
        if written + mv.nbytes > n:
            raise ValueError(f"tensor {t.name!r}: data source yields more than {n} bytes")
        f.write(mv)
        written += mv.nbytes
    if written != n:
        raise ValueError(f"tensor {t.name!r}: data source yielded {written} bytes, needs {n}")


def write_gguf(path: str | os.PathLike, metadata: dict[str, Any], tensors: Sequence[TensorSpec],
               *, sparse: bool = False, alignment: int = DEFAULT_ALIGNMENT) -> int:
    """Write a GGUF v3 file; returns its size in bytes.

    With `sparse=True`, tensors whose data is None (and alignment padding) are left as holes,
    so a 63 GB header-only model costs no disk.
    """
    if alignment <= 0 or alignment & (alignment - 1) or alignment % 8:
        raise ValueError(f"alignment {alignment} must be a power of two and a multiple of 8")
    head, offsets = header_and_offsets(metadata, tensors, alignment)
    total = len(head) + (offsets[-1] + tensors[-1].nbytes if tensors else 0)
    with open(path, "wb") as f:
        f.write(head)
        for t, off in zip(tensors, offsets):
            pad = len(head) + off - f.tell()
            if sparse:
                f.seek(pad, os.SEEK_CUR)
            else:
                f.write(b"\0" * pad)
            _write_data(f, t, sparse)
        f.truncate(total)
    return total


def shard_path(path: str | os.PathLike, k: int, n: int) -> str:
    """`dir/model.gguf` -> `dir/model-0000k-of-0000n.gguf` (k is 1-based)."""
    p = os.fspath(path)
    base = p[:-5] if p.endswith(".gguf") else p
    return f"{base}-{k:05d}-of-{n:05d}.gguf"


def write_split(path: str | os.PathLike, metadata: dict[str, Any], tensors: Sequence[TensorSpec],
                *, max_shard_bytes: int, sparse: bool = False,
                alignment: int = DEFAULT_ALIGNMENT) -> list[str]:
    """Write `*-0000k-of-0000n.gguf` shards, each holding tensors (in order) up to
    `max_shard_bytes` of data (at least one tensor each). Shard 1 carries all metadata;
    every shard carries split.no / split.count / split.tensors.count. Returns the shard paths."""
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += _align(t.nbytes, alignment)
    n = len(groups)
    paths = []
    for k, group in enumerate(groups):
        split = {Keys.SPLIT_NO: (k, GGUFValueType.UINT16),
                 Keys.SPLIT_COUNT: (n, GGUFValueType.UINT16),
                 Keys.SPLIT_TENSORS_COUNT: (len(tensors), GGUFValueType.INT32)}
        meta = {**metadata, **split} if k == 0 else split
        paths.append(shard_path(path, k + 1, n))
        write_gguf(paths[-1], meta, group, sparse=sparse, alignment=alignment)
    return paths
