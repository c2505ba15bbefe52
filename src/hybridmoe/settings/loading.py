"""Model loading settings: what is checked in the file before the model is built (`--check-tensors`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class LoadSettings:
    """check_tensors (--check-tensors): read every tensor first and refuse a file with an inf/NaN
    block scale or float value (quant.check), as llama-server's flag does. Off, nothing is read
    in full up front: a 65 GB file pages in as it is used."""

    check_tensors: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LoadSettings:
        return cls(check_tensors=args.check_tensors)


def add_load_args(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    g = parser.add_argument_group("model loading")
    return [
        g.add_argument("--check-tensors", action="store_true",
                       help="check model tensor data for invalid values: every block scale and F32/F16/BF16 "
                            "value must be finite, or the file is refused naming tensor and value. Reads the "
                            "whole file before anything starts (disk speed; seconds when it is cached)"),
    ]
