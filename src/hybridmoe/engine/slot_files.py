"""Slot state files (`POST /slots/{id}?action=save|restore`): a slot's tokens and KV state on disk.

Layout, version 1 (little-endian):
    8 bytes  magic b"HMSLOT\\x00\\x01"
    u32      header length H, then H bytes of UTF-8 JSON: format version, model identity, context
             per slot, KV dtype, tokens, ring_lo, per-tensor shapes/dtypes, checkpoints, payload
             size and SHA-256
    payload  the tensors' raw bytes in header order
A file for another model, context size or KV type is refused naming the mismatch; a truncated or
altered file fails its size or checksum test before any tensor is built.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import torch

from hybridmoe.models.kv_cache import KVSnapshot

MAGIC = b"HMSLOT\x00\x01"
VERSION = 1
MAX_HEADER = 64 * 2**20  # tokens of a 1M-token context fit with room to spare

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64}


class SlotFileError(ValueError):
    """The file cannot be restored into this server (message names the reason)."""


@dataclass
class SavedSlot:
    """A slot's state as a file holds it: the tokens, their KV state and its checkpoints."""

    tokens: list[int]
    snapshot: KVSnapshot
    checkpoints: list[KVSnapshot]


def model_identity(model_file: Any, n_ctx: int, kv_dtype: torch.dtype) -> dict[str, Any]:
    """What must match for a saved state to be valid here: the weights (tensor table plus sampled
    bytes of the first and last tensors), the context per slot and the KV type."""
    h = hashlib.sha256()
    infos = sorted(model_file.tensors.values(), key=lambda t: (t.file_index, t.offset))
    for t in infos:
        h.update(f"{t.name}:{int(t.ggml_type)}:{t.ne}:{t.nbytes};".encode())
    for t in (infos[0], infos[-1]):
        raw = np.asarray(model_file.raw(t.name)).reshape(-1)
        h.update(raw[: 1 << 16].tobytes())
    meta = model_file.metadata
    return {
        "architecture": str(meta.get("general.architecture")),
        "name": str(meta.get("general.name", "")),
        "fingerprint": h.hexdigest(),
        "n_ctx": int(n_ctx),
        "kv_dtype": str(kv_dtype).removeprefix("torch."),
    }


def _tensors(snap: KVSnapshot) -> list[torch.Tensor | None]:
    return [x for layer in snap.layers for x in (layer if layer is not None else (None, None, None))]


def _describe(snap: KVSnapshot) -> dict[str, Any]:
    return {"length": snap.length, "ring_lo": snap.ring_lo,
            "tensors": [None if t is None else [list(t.shape), str(t.dtype).removeprefix("torch.")]
                        for t in _tensors(snap)]}


def save(path: str, identity: dict[str, Any], state: SavedSlot) -> int:
    """Write the file (through a temporary name, so a crash leaves no half file); returns bytes."""
    snaps = [state.snapshot, *state.checkpoints]
    payload = [t.contiguous().view(torch.uint8).numpy().reshape(-1) for s in snaps for t in _tensors(s) if t is not None]
    digest = hashlib.sha256()
    for p in payload:
        digest.update(memoryview(p))
    header = {
        "version": VERSION, "model": identity, "tokens": state.tokens,
        "state": _describe(state.snapshot), "checkpoints": [_describe(c) for c in state.checkpoints],
        "payload_bytes": int(sum(p.nbytes for p in payload)), "payload_sha256": digest.hexdigest(),
    }
    raw = json.dumps(header).encode()
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<I", len(raw)) + raw)
        for p in payload:
            f.write(memoryview(p))
    os.replace(tmp, path)
    return len(MAGIC) + 4 + len(raw) + header["payload_bytes"]


def load(path: str, identity: dict[str, Any]) -> tuple[SavedSlot, int]:
    """Read and check a file; returns the state and the bytes read. Raises SlotFileError."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        header = _read_header(f, path)
        _check_identity(header.get("model"), identity)
        payload_bytes = header.get("payload_bytes")
        start = f.tell()
        if not isinstance(payload_bytes, int) or size - start != payload_bytes:
            raise SlotFileError(f"{os.path.basename(path)}: truncated or padded: {size - start} payload bytes, "
                                f"header says {payload_bytes}")
        data = f.read()
    if hashlib.sha256(data).hexdigest() != header.get("payload_sha256"):
        raise SlotFileError(f"{os.path.basename(path)}: payload checksum mismatch (file corrupt)")
    buf = bytearray(data)
    offset = 0

    def snapshot(desc: Any) -> KVSnapshot:
        nonlocal offset
        try:
            tensors = []
            for d in desc["tensors"]:
                if d is None:
                    tensors.append(None)
                    continue
                shape, dtype = [int(x) for x in d[0]], _DTYPES[d[1]]
                n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
                if n < 0 or offset + n > len(buf):
                    raise SlotFileError("tensor sizes exceed the payload")
                tensors.append(torch.frombuffer(buf, dtype=dtype, count=int(np.prod(shape)), offset=offset).view(shape)
                               if n else torch.empty(shape, dtype=dtype))
                offset += n
            if len(tensors) % 3:
                raise SlotFileError("tensor list is not whole layers")
            layers = [None if t[0] is None else (t[0], t[1], t[2]) for t in zip(*[iter(tensors)] * 3)]
            return KVSnapshot(int(desc["length"]), int(desc["ring_lo"]), layers)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            if isinstance(e, SlotFileError):
                raise
            raise SlotFileError(f"{os.path.basename(path)}: malformed state description ({type(e).__name__}: {e})") from None

    main = snapshot(header.get("state"))
    cks = [snapshot(c) for c in header.get("checkpoints") or []]
    tokens = header.get("tokens")
    if not isinstance(tokens, list) or len(tokens) != main.length or not all(isinstance(t, int) for t in tokens):
        raise SlotFileError(f"{os.path.basename(path)}: token list does not match the state length")
    return SavedSlot(tokens, main, cks), size


def _read_header(f: BinaryIO, path: str) -> dict[str, Any]:
    name = os.path.basename(path)
    head = f.read(len(MAGIC) + 4)
    if len(head) < len(MAGIC) + 4 or head[: len(MAGIC) - 1] != MAGIC[:-1]:
        raise SlotFileError(f"{name}: not a hybridmoe slot file")
    if head[len(MAGIC) - 1] != VERSION:
        raise SlotFileError(f"{name}: slot file format version {head[len(MAGIC) - 1]}, this server reads {VERSION}")
    (n,) = struct.unpack("<I", head[len(MAGIC):])
    if n > MAX_HEADER:
        raise SlotFileError(f"{name}: header of {n} bytes is larger than {MAX_HEADER}")
    raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise SlotFileError(f"{name}: header is not valid JSON (truncated or corrupt)") from None
    if not isinstance(header, dict):
        raise SlotFileError(f"{name}: header is not a JSON object")
    return header


def _check_identity(saved: Any, here: dict[str, Any]) -> None:
    if not isinstance(saved, dict):
        raise SlotFileError("the file names no model")
    for key, what in (("architecture", "architecture"), ("fingerprint", "model weights"),
                      ("n_ctx", "context size per slot"), ("kv_dtype", "KV cache type")):
        if saved.get(key) != here[key]:
            raise SlotFileError(f"the file was saved for another {what}: {key} {saved.get(key)!r}, "
                                f"this server {here[key]!r}" + (f" (model {saved.get('name')!r})" if key == "fingerprint" else ""))
