"""Bounds-checked reads of a GGUF header from the mapped file: HeaderCursor decodes scalars,
strings and typed metadata values (arrays, with a numpy path for big string arrays) and checks
every length against the file size, with limits far above real models, before it allocates."""

from __future__ import annotations

import logging
import struct
from typing import Any

import numpy as np

from hybridmoe.gguf.constants import VALUE_DTYPES, GGUFValueType
from hybridmoe.gguf.errors import GGUFError

log = logging.getLogger(__name__)

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_STRUCT_CHARS = {"u1": "B", "i1": "b", "u2": "H", "i2": "h", "u4": "I", "i4": "i", "f4": "f",
                 "u8": "Q", "i8": "q", "f8": "d"}
_SCALAR_STRUCTS = {t: struct.Struct("<" + _STRUCT_CHARS[dt[1:]]) for t, dt in VALUE_DTYPES.items()}
# Sanity limits for corrupt headers in huge (possibly sparse) files, far above real models
# (gpt-oss: 446k merges); checked before the matching allocations.
MAX_ARRAY_ITEMS = 1 << 24
MAX_ARRAY_DEPTH = 16  # arrays of arrays: real files nest at most 2 levels
_FAST_WINDOW_MAX = 1 << 26  # bytes scanned by the numpy string-offset search


class HeaderCursor:
    """Sequential little-endian reads from the mapped header; errors mention what was being read."""

    def __init__(self, path: str, buf: memoryview, size: int) -> None:
        self.path, self.buf, self.size, self.pos = path, buf, size, 0
        self.last_elem_type: GGUFValueType | None = None  # of the last array read: kept with its key

    def fail(self, msg: str) -> GGUFError:
        return GGUFError(f"{self.path}: {msg}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"truncated header: {what} needs {n} bytes at offset {self.pos}, "
                            f"file has {self.size}")

    def u32(self, what: str) -> int:
        self.need(4, what)
        v = _U32.unpack_from(self.buf, self.pos)[0]
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        v = _U64.unpack_from(self.buf, self.pos)[0]
        self.pos += 8
        return v

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        if n > self.size - self.pos:
            raise self.fail(f"{what}: string length {n} exceeds the file size ({self.size})")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            log.warning("%s: %s is not valid UTF-8; undecodable bytes replaced", self.path, what)
            return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str) -> Any:
        vt = _value_type(self, vtype, what)
        if vt == GGUFValueType.STRING:
            return self.string(what)
        if vt == GGUFValueType.ARRAY:
            return self.array(what, depth=1)
        st = _SCALAR_STRUCTS[vt]
        self.need(st.size, what)
        v = st.unpack_from(self.buf, self.pos)[0]
        self.pos += st.size
        return bool(v) if vt == GGUFValueType.BOOL else v

    def array(self, what: str, depth: int) -> list:
        if depth > MAX_ARRAY_DEPTH:
            raise self.fail(f"{what}: arrays nested {depth} deep (limit {MAX_ARRAY_DEPTH})")
        etype = _value_type(self, self.u32(f"element type of {what}"), f"elements of {what}")
        self.last_elem_type = etype
        count = self.u64(f"element count of {what}")
        min_item = 8 if etype in (GGUFValueType.STRING, GGUFValueType.ARRAY) else \
            _SCALAR_STRUCTS[etype].size
        if count * min_item > self.size - self.pos:
            raise self.fail(f"{what}: array of {count} {etype.name} exceeds the file size ({self.size})")
        if count > MAX_ARRAY_ITEMS:
            raise self.fail(f"{what}: absurd array length {count} (limit {MAX_ARRAY_ITEMS})")
        if etype == GGUFValueType.STRING:
            return self.string_array(count, what)
        if etype == GGUFValueType.ARRAY:
            return [self.array(f"{what}[{i}]", depth + 1) for i in range(count)]
        arr = np.frombuffer(self.buf, dtype=VALUE_DTYPES[etype], count=count, offset=self.pos)
        self.pos += arr.nbytes
        return arr.astype(bool).tolist() if etype == GGUFValueType.BOOL else arr.tolist()

    def _string_starts_loop(self, count: int, what: str) -> tuple[np.ndarray, int]:
        buf, unpack, pos = self.buf, _U64.unpack_from, self.pos
        starts = [0] * count
        try:
            for i in range(count):
                n = unpack(buf, pos)[0]
                pos += 8
                starts[i] = pos
                pos += n
        except struct.error:
            raise self.fail(f"{what}: truncated or absurd string lengths in the array") from None
        return np.asarray(starts, dtype=np.int64), pos

    def string_array(self, count: int, what: str) -> list[str]:
        """Big string arrays (201k tokens, 446k merges) without a per-item Python loop in the
        common case: offsets found with numpy, bytes decoded in one call and split."""
        buf, size = self.buf, self.size
        pos0 = self.pos
        found = _string_starts_fast(buf, pos0, count, size)
        if found is not None:
            starts, pos = found
        else:
            starts, pos = self._string_starts_loop(count, what)
        if pos > size:
            raise self.fail(f"{what}: string data runs past the end of the file ({size} bytes)")
        self.pos = pos
        if count == 0:
            return []
        region = np.array(np.frombuffer(buf, dtype=np.uint8, count=pos - pos0, offset=pos0))
        st = starts - pos0  # payload starts within region
        # Turn each 8-byte length prefix into one NUL separator, decode everything at once, split.
        # Valid only if no string holds a NUL and no character straddles two strings; the fallback
        # (decode item by item) handles those files.
        keep = np.ones(region.size, dtype=bool)
        keep[((st - 8)[:, None] + np.arange(7)).ravel()] = False
        keep[st[0] - 1] = False
        region[st - 1] = 0
        payload = region[keep]
        if np.count_nonzero(payload == 0) == count - 1:
            try:
                out = payload.tobytes().decode("utf-8").split("\0")
                if len(out) == count:
                    return out
            except UnicodeDecodeError:
                pass
        ends = starts[1:].tolist() + [pos + 8]
        items = [bytes(buf[a:e - 8]) for a, e in zip(starts.tolist(), ends)]
        try:
            return [x.decode("utf-8") for x in items]
        except UnicodeDecodeError:
            log.warning("%s: %s holds invalid UTF-8; undecodable bytes replaced", self.path, what)
            return [x.decode("utf-8", errors="replace") for x in items]


def _string_starts_fast(buf: memoryview, pos0: int, count: int, size: int
                        ) -> tuple[np.ndarray, int] | None:
    """Payload offsets of `count` length-prefixed strings at pos0, found with numpy, or None.

    Candidates are bytes that follow a zero byte but are not zero (a prefix's top byte is zero,
    a payload's first byte usually is not). The result is proven, not guessed: candidate 0 must be
    pos0 + 8 and each candidate must be exactly where its predecessor's length says. Arrays with
    empty strings, NULs or lengths >= 256 usually fail the proof and take the Python loop.
    """
    if count == 0:
        return None
    limit = min(size - pos0, _FAST_WINDOW_MAX)
    window = min(limit, count * 32)
    while True:
        r = np.frombuffer(buf, dtype=np.uint8, count=window, offset=pos0)
        cand = np.flatnonzero((r[:-1] == 0) & (r[1:] != 0)) + 1
        if cand.size >= count:
            c = cand[:count]
            if c[0] != 8:
                return None
            lens = r[c - 8].astype(np.int64)
            for k in range(1, 8):
                lens |= r[c - 8 + k].astype(np.int64) << (8 * k)
            nxt = c + lens + 8
            if not np.array_equal(nxt[:-1], c[1:]):
                return None
            end = int(nxt[-1]) - 8
            if end <= window:
                return c + pos0, pos0 + end
        if window >= limit:
            return None
        window = min(limit, window * 2)


def _value_type(cur: HeaderCursor, vtype: int, what: str) -> GGUFValueType:
    try:
        return GGUFValueType(vtype)
    except ValueError:
        raise cur.fail(f"{what}: unknown metadata value type {vtype}") from None
