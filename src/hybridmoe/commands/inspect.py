"""`hybridmoe inspect -m MODEL`: print a GGUF's metadata and tensor table. Imports no torch."""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from typing import Any

from hybridmoe.gguf.errors import GGUFError
from hybridmoe.gguf.reader import ModelFile, open_model

MAX_ARRAY_ITEMS = 16  # longer arrays print as a summary such as "[201088 strings]"
MAX_STR_CHARS = 120


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("inspect", help="print a GGUF model's metadata and tensor table",
                       description=__doc__)
    p.add_argument("-m", "--model", required=True, help="GGUF file (first shard of a split model)")
    p.add_argument("--no-tensors", action="store_true", help="metadata only")
    return p


def _fmt_str(s: str) -> str:
    r = repr(s)
    return r if len(r) <= MAX_STR_CHARS else f"{r[:MAX_STR_CHARS]}... ({len(s)} chars)"


def format_value(v: Any) -> str:
    """Short one-line rendering of a metadata value; long arrays become a summary."""
    if isinstance(v, str):
        return _fmt_str(v)
    if isinstance(v, list):
        if len(v) > MAX_ARRAY_ITEMS:
            kinds = {type(x).__name__ for x in v[:1000]}
            names = {"str": "strings", "int": "ints", "float": "floats", "bool": "bools",
                     "list": "arrays"}
            kind = names.get(kinds.pop(), "items") if len(kinds) == 1 else "items"
            return f"[{len(v)} {kind}]"
        return "[" + ", ".join(format_value(x) for x in v) + "]"
    return repr(v)


def _human(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def print_model(m: ModelFile, tensors: bool = True, out=sys.stdout) -> None:
    f0 = m.files[0]
    total = sum(t.nbytes for t in m.tensors.values())
    shards = f" ({len(m.files)} shards)" if len(m.files) > 1 else ""
    print(f"file: {m.path}{shards}", file=out)
    print(f"GGUF v{f0.version}, alignment {f0.alignment}, {len(m.tensors)} tensors, "
          f"{_human(total)} of tensor data", file=out)
    print(f"\nmetadata ({len(m.metadata)} keys):", file=out)
    width = max((len(k) for k in m.metadata), default=0)
    for k, v in m.metadata.items():
        vt = m.value_types[k].name
        if k in m.array_types:
            vt = f"{m.array_types[k].name}[]"
        print(f"  {k:<{width}}  {vt:<9}  {format_value(v)}", file=out)
    if not tensors:
        return
    print("\ntensors:", file=out)
    nw = max((len(n) for n in m.tensors), default=4)
    print(f"  {'name':<{nw}}  {'type':<6}  {'shape (ggml ne)':<22}  {'bytes':>14}", file=out)
    per_type: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for name, t in m.tensors.items():
        shape = "[" + ", ".join(str(d) for d in t.ne) + "]"
        print(f"  {name:<{nw}}  {t.ggml_type.name:<6}  {shape:<22}  {t.nbytes:>14,}", file=out)
        per_type[t.ggml_type.name][0] += 1
        per_type[t.ggml_type.name][1] += t.nbytes
    print("\ntotals by type:", file=out)
    for name, (count, nbytes) in sorted(per_type.items(), key=lambda kv: -kv[1][1]):
        print(f"  {name:<6}  {count:>5} tensors  {nbytes:>16,} bytes  ({_human(nbytes)})", file=out)
    print(f"  {'total':<6}  {len(m.tensors):>5} tensors  {total:>16,} bytes  ({_human(total)})",
          file=out)


def run(args: argparse.Namespace) -> int:
    try:
        m = open_model(args.model)
    except GGUFError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    with m:
        print_model(m, tensors=not args.no_tensors)
    return 0
