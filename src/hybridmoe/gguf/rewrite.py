"""Rewrite a GGUF file's metadata while keeping its tensor data byte for byte.

The header is re-encoded with every key's stored type (so an int stays UINT32 or INT32 as it was),
then the data section is copied unchanged: tensor offsets are relative to the data start, which
only moves to the next alignment boundary after the new header.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from hybridmoe.gguf.constants import GGUFValueType
from hybridmoe.gguf.errors import GGUFError
from hybridmoe.gguf.reader import GGUFFile
from hybridmoe.gguf.writer import TensorSpec, header_and_offsets


def replace_metadata(src: str | os.PathLike, dst: str | os.PathLike, updates: dict[str, Any]) -> None:
    """Write `dst`: `src` with the metadata keys in `updates` replaced (or added, types inferred);
    tensors and their data identical. `src` and `dst` must differ."""
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError("replace_metadata writes a new file: src and dst must differ")
    g = GGUFFile(src)
    meta: dict[str, Any] = {}
    for key, value in g.metadata.items():
        vt = g.value_types[key]
        typed = g.array_types[key] if vt == GGUFValueType.ARRAY else vt
        meta[key] = updates[key] if key in updates else (value, typed)
    for key, value in updates.items():
        meta.setdefault(key, value)
    infos = sorted(g.tensors.values(), key=lambda t: t.offset)
    specs = [TensorSpec(t.name, t.ggml_type, t.ne) for t in infos]
    head, offsets = header_and_offsets(meta, specs, g.alignment)
    for t, off in zip(infos, offsets):
        if g.data_offset + off != t.offset:
            raise GGUFError(f"{g.path}: tensor {t.name!r} is not where a rewrite would put it (its file has "
                            "unusual padding); not rewriting")
    data_offset = g.data_offset
    del g
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        fout.write(head)
        fin.seek(data_offset)
        shutil.copyfileobj(fin, fout, 16 << 20)
