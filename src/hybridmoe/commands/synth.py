"""`hybridmoe synth --preset tiny|20b|120b --out PATH`: write a synthetic gpt-oss GGUF."""

from __future__ import annotations

import argparse
import time


def add_parser(sub: argparse._SubParsersAction) -> None:
    from hybridmoe.synth import PRESETS

    p = sub.add_parser("synth", help="write a synthetic gpt-oss GGUF (random seeded weights)")
    p.add_argument("--preset", choices=list(PRESETS), default="tiny")
    p.add_argument("--out", required=True, help="output .gguf path")
    p.add_argument("--layers", type=int, default=None, help="override the layer count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sparse", action="store_true", help="header only; data left as a sparse hole")


def run(args: argparse.Namespace) -> int:
    from hybridmoe.synth import write_synthetic

    t0 = time.perf_counter()
    write_synthetic(args.out, args.preset, seed=args.seed, n_layers=args.layers, sparse=args.sparse)
    import os

    size = os.path.getsize(args.out)
    human = f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.2f} MB"
    print(f"wrote {args.out}: {human} ({'sparse' if args.sparse else 'dense'}) "
          f"in {time.perf_counter() - t0:.1f} s")
    return 0
