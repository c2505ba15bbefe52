"""`hybridmoe synth --preset tiny|tiny256|20b|120b [--ftype NAME] [--quantized-experts] --out PATH`:
write a synthetic gpt-oss GGUF with a published file type's tensor types."""

from __future__ import annotations

import argparse
import os
import sys
import time


def _ftype(value: str) -> str:
    """argparse type: the canonical ftype name, or a usage error that lists the choices."""
    from hybridmoe.quant_mix import ftype_name

    try:
        return ftype_name(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def ftype_table(preset: str = "20b") -> list[str]:
    """One line per ftype: its number and the types each weight role gets in the preset's shape
    (after the row-size fallbacks); the experts' column is their --quantized-experts type."""
    from hybridmoe.quant_mix import MIXES
    from hybridmoe.synth import PRESETS, synth_tensors

    lines = []
    for name, mix in MIXES.items():
        roles: dict[str, list[str]] = {}
        for spec in synth_tensors(PRESETS[preset], 0, True, name, quantized_experts=True):
            if spec.ggml_type.name == "F32":
                continue  # norms, biases, sinks, router: F32 in every file
            role = spec.name.split(".")[-2] if spec.name.startswith("blk.") else spec.name.split(".")[0]
            role = {"ffn_gate_exps": "gate/up*", "ffn_up_exps": "gate/up*", "ffn_down_exps": "down*"}.get(role, role)
            if spec.ggml_type.name not in roles.setdefault(role, []):
                roles[role].append(spec.ggml_type.name)
        cells = "  ".join(f"{k} {'/'.join(v)}" for k, v in roles.items())
        lines.append(f"{name:<9} ({mix.file_type:>2})  {cells}")
    return lines


class _ListFtypes(argparse.Action):
    """--list-ftypes: print the table and exit, like --help (so --out stays required otherwise)."""

    def __call__(self, parser: argparse.ArgumentParser, *_: object, **__: object) -> None:
        print(f"file type (llama.cpp ftype number): tensor types in a {_LIST_PRESET} file; A/B: per layer;"
              " *: experts with --quantized-experts (MXFP4 without)")
        print("\n".join(ftype_table(_LIST_PRESET)))
        parser.exit()


_LIST_PRESET = "20b"


def add_parser(sub: argparse._SubParsersAction) -> None:
    from hybridmoe.quant_mix import DEFAULT_FTYPE, MIXES
    from hybridmoe.synth import PRESETS

    p = sub.add_parser("synth", help="write a synthetic gpt-oss GGUF (random seeded weights)")
    p.add_argument("--preset", choices=list(PRESETS), default="tiny")
    p.add_argument("--out", required=True, help="output .gguf path")
    p.add_argument("--layers", type=int, default=None, help="override the layer count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sparse", action="store_true", help="header only; data left as a sparse hole")
    p.add_argument("--ftype", type=_ftype, default=DEFAULT_FTYPE, metavar="NAME",
                   help=f"llama-quantize file type whose per-tensor types to write (any case): "
                        f"{', '.join(MIXES)}; default {DEFAULT_FTYPE} (ggml-org's release)")
    p.add_argument("--quantized-experts", action="store_true",
                   help="quantize the routed experts by the ftype's rules (a fine-tune) instead of keeping MXFP4")
    p.add_argument("--list-ftypes", action=_ListFtypes, nargs=0,
                   help=f"print each file type's tensor types in a {_LIST_PRESET} file and exit")


def run(args: argparse.Namespace) -> int:
    from hybridmoe.synth import write_synthetic

    t0 = time.perf_counter()
    write_synthetic(args.out, args.preset, seed=args.seed, n_layers=args.layers, sparse=args.sparse,
                    ftype=args.ftype, quantized_experts=args.quantized_experts)
    size = os.path.getsize(args.out)
    human = f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.2f} MB"
    experts = ", quantized experts" if args.quantized_experts else ""
    print(f"wrote {args.out}: {human} {args.ftype}{experts} ({'sparse' if args.sparse else 'dense'}) "
          f"in {time.perf_counter() - t0:.1f} s")
    sys.stdout.flush()
    return 0
