"""GGUF reader over np.memmap: header, metadata, tensor index, zero-copy read-only tensor views.

`open_model(path)` returns a `ModelFile` that also handles split models (`X-00001-of-00003.gguf`).
Every malformed or unsupported file raises `GGUFError` naming the file and the problem, and all
sizes/counts are checked against the file size before anything big is allocated.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridmoe.gguf.constants import (
    BLOCK_SIZES,
    DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    MAX_DIMS,
    SUPPORTED_VERSIONS,
    GGMLType,
    GGUFValueType,
    Keys,
)
from hybridmoe.gguf.errors import GGUFError
from hybridmoe.gguf.header import HeaderCursor

MAX_TENSORS = 1 << 20  # a corrupt header's tensor count, refused before the table is read (gpt-oss: 687)
_SPLIT_RE = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: GGMLType
    ne: tuple[int, ...]  # ggml order, ne[0] innermost
    shape: tuple[int, ...]  # numpy order = reversed(ne)
    nbytes: int
    file_index: int  # which shard of a split model (0 for single files)
    offset: int  # absolute byte offset in its file


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def check_regular_file(path: str | os.PathLike) -> None:
    """GGUFError unless `path` is a regular file (links followed). Checked with stat, never by
    opening: opening a FIFO blocks and a device reads forever."""
    p = os.fspath(path)
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        raise GGUFError(f"{p}: model file not found") from None
    except OSError as e:
        raise GGUFError(f"{p}: cannot open: {e.strerror or e}") from None
    for test, kind in _KINDS:
        if test(mode):
            raise GGUFError(f"{p}: is {kind}, not a GGUF model file")
    if not stat.S_ISREG(mode):
        raise GGUFError(f"{p}: is not a regular file")


class GGUFFile:
    """One GGUF file: parsed header + a read-only memmap of the whole file."""

    def __init__(self, path: str | os.PathLike, file_index: int = 0) -> None:
        self.path = os.fspath(path)
        self.file_index = file_index
        check_regular_file(self.path)
        try:
            size = os.path.getsize(self.path)
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot open: {e.strerror}") from None
        if size < 24:
            raise GGUFError(f"{self.path}: truncated header: file is {size} bytes, a GGUF header "
                            f"needs at least 24")
        self.size = size
        try:
            self._mm: np.memmap | None = np.memmap(self.path, dtype=np.uint8, mode="r")
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot open: {e.strerror or e}") from None
        cur = HeaderCursor(self.path, memoryview(self._mm), size)
        self._parse(cur)

    # ---- parsing -------------------------------------------------------------------------------
    def _parse(self, cur: HeaderCursor) -> None:
        magic = cur.u32("magic")
        if magic != GGUF_MAGIC:
            raise cur.fail(f"not a GGUF file (magic bytes {bytes(cur.buf[0:4])!r}, expected b'GGUF')")
        version = cur.u32("version")
        if version not in SUPPORTED_VERSIONS:
            if version & 0xFFFF == 0 and (version >> 16) in (2, 3):
                raise cur.fail("big-endian GGUF files are not supported")
            raise cur.fail(f"unsupported GGUF version {version} (supported: 2, 3)")
        self.version = version
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        # smallest KV: key len(8)+1 byte+type(4)+1 byte value; smallest tensor info: 8+1+4+4+8
        if n_kv * 14 > self.size:
            raise cur.fail(f"absurd metadata count {n_kv} for a {self.size}-byte file")
        if n_tensors * 25 > self.size or n_tensors > MAX_TENSORS:
            raise cur.fail(f"absurd tensor count {n_tensors} for a {self.size}-byte file")
        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, GGUFValueType] = {}
        self.array_types: dict[str, GGUFValueType] = {}  # element type of each ARRAY value
        for i in range(n_kv):
            key = cur.string(f"key of metadata entry {i}")
            vtype = cur.u32(f"type of metadata {key!r}")
            if key in self.metadata:
                raise cur.fail(f"duplicate metadata key {key!r}")
            self.metadata[key] = cur.value(vtype, f"metadata {key!r}")
            self.value_types[key] = GGUFValueType(vtype)
            if vtype == GGUFValueType.ARRAY:
                self.array_types[key] = cur.last_elem_type
        self.alignment = self._alignment(cur)
        raw_infos, names = [], set()
        for i in range(n_tensors):
            raw_infos.append(self._tensor_info(cur, i))
            if raw_infos[-1][0] in names:  # checked here so corrupt counts stop early
                raise cur.fail(f"duplicate tensor name {raw_infos[-1][0]!r}")
            names.add(raw_infos[-1][0])
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, ne, gtype, rel in raw_infos:
            self.tensors[name] = self._finish_info(cur, name, ne, gtype, rel)
        self._check_no_overlap(cur)

    def _check_no_overlap(self, cur: HeaderCursor) -> None:
        """Tensor data ranges must be disjoint: an offset pointing into another tensor's bytes
        would load silently as garbage."""
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values() if t.nbytes)
        for (_, end, name), (start, _, other) in zip(spans, spans[1:]):
            if start < end:
                raise cur.fail(f"tensor {other!r}: offset = {start - self.data_offset} overlaps tensor "
                               f"{name!r} (its data ends at {end - self.data_offset})")

    def _alignment(self, cur: HeaderCursor) -> int:
        a = self.metadata.get(Keys.ALIGNMENT, DEFAULT_ALIGNMENT)
        if not isinstance(a, int) or isinstance(a, bool) or a <= 0 or a & (a - 1):
            raise cur.fail(f"{Keys.ALIGNMENT} = {a!r} is not a positive power of two")
        return a

    def _tensor_info(self, cur: HeaderCursor, i: int) -> tuple[str, tuple[int, ...], int, int]:
        name = cur.string(f"name of tensor {i}")
        n_dims = cur.u32(f"n_dims of tensor {name!r}")
        if n_dims > MAX_DIMS:
            raise cur.fail(f"tensor {name!r}: n_dims = {n_dims} > {MAX_DIMS}")
        ne = tuple(cur.u64(f"ne[{d}] of tensor {name!r}") for d in range(n_dims))
        gtype = cur.u32(f"type of tensor {name!r}")
        rel = cur.u64(f"offset of tensor {name!r}")
        return name, ne, gtype, rel

    def _finish_info(self, cur: HeaderCursor, name: str, ne: tuple[int, ...], gtype: int,
                     rel: int) -> TensorInfo:
        try:
            t = GGMLType(gtype)
        except ValueError:
            raise cur.fail(f"tensor {name!r}: unknown ggml type id {gtype}") from None
        be, bb = BLOCK_SIZES[t]
        ne0 = ne[0] if ne else 1
        if ne0 % be:
            raise cur.fail(f"tensor {name!r}: ne[0] = {ne0} is not a multiple of the {t.name} "
                           f"block size {be}")
        if rel % self.alignment:
            raise cur.fail(f"tensor {name!r}: data offset {rel} is not a multiple of the "
                           f"alignment {self.alignment}")
        nbytes = ne0 // be * bb
        for d in ne[1:]:
            nbytes *= d
        start = self.data_offset + rel
        if start + nbytes > self.size:
            raise cur.fail(f"truncated data: tensor {name!r} ({t.name}, ne={list(ne)}) spans bytes "
                           f"{start}..{start + nbytes} but the file has {self.size}")
        return TensorInfo(name=name, ggml_type=t, ne=ne, shape=tuple(reversed(ne)), nbytes=nbytes,
                          file_index=self.file_index, offset=start)

    # ---- views ---------------------------------------------------------------------------------
    def raw(self, info: TensorInfo) -> np.ndarray:
        if self._mm is None:
            raise GGUFError(f"{self.path}: file is closed")
        flat = self._mm[info.offset:info.offset + info.nbytes]
        if not info.ne:
            return flat
        be, bb = BLOCK_SIZES[info.ggml_type]
        return flat.reshape(info.shape[:-1] + (info.ne[0] // be * bb,))

    def mapped_range(self) -> tuple[int, int] | None:
        """(address, length) of this file's mapping, for madvise/mlock; None once closed."""
        if self._mm is None or self._mm.size == 0:
            return None
        return self._mm.__array_interface__["data"][0], int(self._mm.size)

    def close(self) -> None:
        # Views handed out keep the mapping alive; closing the mmap under them would crash.
        self._mm = None


_TYPED_VIEWS = {GGMLType.F32: np.float32, GGMLType.F16: np.float16}


class ModelFile:
    """A (possibly split) GGUF model: metadata from shard 1, tensor table merged over all shards."""

    def __init__(self, files: list[GGUFFile]) -> None:
        self.files = files
        self.path = files[0].path
        self.metadata: dict[str, Any] = files[0].metadata
        self.value_types: dict[str, GGUFValueType] = files[0].value_types
        self.array_types: dict[str, GGUFValueType] = files[0].array_types
        self.tensors: dict[str, TensorInfo] = {}
        for f in files:
            for name, info in f.tensors.items():
                if name in self.tensors:
                    first = files[self.tensors[name].file_index].path
                    raise GGUFError(f"{f.path}: duplicate tensor name {name!r} (also in {first})")
                self.tensors[name] = info

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: missing tensor {name!r}") from None

    def raw(self, name: str) -> np.ndarray:
        """uint8 read-only memmap view; shape = shape[:-1] + (row_bytes,). Zero copy."""
        info = self.info(name)
        return self.files[info.file_index].raw(info)

    def array(self, name: str) -> np.ndarray:
        """F32 -> float32 view, F16 -> float16 view (numpy shape); other types: raw()."""
        info = self.info(name)
        r = self.files[info.file_index].raw(info)
        dt = _TYPED_VIEWS.get(info.ggml_type)
        if dt is None:
            return r
        return r.view(dt).reshape(info.shape) if info.ne else r.view(dt)

    def require(self, name: str, ne: Iterable[int] | None = None,
                types: GGMLType | Iterable[GGMLType] | None = None) -> TensorInfo:
        """Check that tensor `name` exists with ggml dims `ne` and one of `types`; return its info."""
        info = self.info(name)
        if ne is not None and tuple(ne) != info.ne:
            raise GGUFError(f"{self.path}: tensor {name!r}: expected shape (ggml ne) "
                            f"{list(ne)} got {list(info.ne)}")
        if types is not None:
            allowed = (types,) if isinstance(types, GGMLType) else tuple(types)
            if info.ggml_type not in allowed:
                raise GGUFError(f"{self.path}: tensor {name!r}: type {info.ggml_type.name} not "
                                f"supported here (expected {', '.join(t.name for t in allowed)})")
        return info

    def typed_metadata(self) -> dict[str, Any]:
        """Metadata as `(value, type)` tuples (element type for arrays), the form write_gguf takes,
        so a rewritten file keeps the exact value types."""
        return {k: (v, self.array_types.get(k, self.value_types[k]))
                for k, v in self.metadata.items()}

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> ModelFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def split_paths(path: str | os.PathLike) -> list[str] | None:
    """Shard paths of a split model named like `X-0000k-of-0000n.gguf`, else None."""
    p = os.fspath(path)
    m = _SPLIT_RE.match(p)
    if not m:
        return None
    count = int(m["count"])
    if count < 1:
        raise GGUFError(f"{p}: split file name says 0 shards")
    return [f"{m['prefix']}-{k:05d}-of-{count:05d}.gguf" for k in range(1, count + 1)]


def open_model(path: str | os.PathLike) -> ModelFile:
    """Open a GGUF model; a shard name `X-0000k-of-0000n.gguf` opens all n shards."""
    shards = split_paths(path)
    if shards is None or len(shards) == 1:
        f = GGUFFile(path)
        if shards is None and int(f.metadata.get(Keys.SPLIT_COUNT, 1)) > 1:
            raise GGUFError(f"{f.path}: {Keys.SPLIT_COUNT} = {f.metadata[Keys.SPLIT_COUNT]} but the "
                            f"name is not of the form X-00001-of-0000N.gguf; cannot find the shards")
        return ModelFile([f])
    for s in shards:
        if not os.path.exists(s):
            raise GGUFError(f"{shards[0]}: missing shard {s} of a {len(shards)}-part split model")
    files = [GGUFFile(s, file_index=i) for i, s in enumerate(shards)]
    for i, f in enumerate(files):
        count = f.metadata.get(Keys.SPLIT_COUNT)
        if count is None:
            raise GGUFError(f"{f.path}: split shard without a {Keys.SPLIT_COUNT} key")
        if int(count) != len(shards):
            raise GGUFError(f"{f.path}: {Keys.SPLIT_COUNT} = {count} but the file name says "
                            f"{len(shards)} shards")
        no = f.metadata.get(Keys.SPLIT_NO)
        if no is not None and int(no) != i:
            raise GGUFError(f"{f.path}: {Keys.SPLIT_NO} = {no}, expected {i}")
    model = ModelFile(files)
    total = files[0].metadata.get(Keys.SPLIT_TENSORS_COUNT)
    if total is not None and int(total) != len(model.tensors):
        raise GGUFError(f"{files[0].path}: {Keys.SPLIT_TENSORS_COUNT} = {total} but the shards hold "
                        f"{len(model.tensors)} tensors")
    return model
