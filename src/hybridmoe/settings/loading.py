"""Model loading settings: what is checked in the file before the model is built (`--check-tensors`),
and how the mapped weights stay in memory (`--mlock`, llama-server's `--no-mmap` and `-lm`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from hybridmoe.settings.values import require


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


# llama-server's -lm/--load-mode values as (pin the weights in RAM: --mlock, read the file instead
# of mapping it: --no-mmap, which changes nothing here). Its "mlock" reads and locks; pinning the
# mapping gives the same resident, locked weights.
LOAD_MODES = {"auto": (False, False), "mmap": (False, False), "none": (False, True), "dio": (False, True),
              "mlock": (True, False), "mmap+mlock": (True, False)}


@dataclass(frozen=True)
class ResidencySettings:
    """How the mapped weights stay in memory. mlock (--mlock): pin them in RAM. no_mmap (--no-mmap)
    and load_mode (-lm/--load-mode): llama-server's loading choices, as far as they mean
    something here (the experts are always used in place from the mapping)."""

    mlock: bool = False
    no_mmap: bool = False
    load_mode: str = "auto"

    def __post_init__(self) -> None:
        require(self.load_mode in LOAD_MODES, "-lm/--load-mode", f"be one of {', '.join(LOAD_MODES)}",
                self.load_mode)

    @property
    def pin(self) -> bool:
        """Whether the mapping is locked in RAM (--mlock, or a load mode that locks)."""
        return self.mlock or LOAD_MODES[self.load_mode][0]

    def notes(self) -> list[str]:
        """What is accepted but served differently (said once at start)."""
        if not (self.no_mmap or LOAD_MODES[self.load_mode][1]):
            return []
        flag = "--no-mmap" if self.no_mmap else f"--load-mode {self.load_mode}"
        return [f"{flag} is accepted, but the experts are always used in place from the mmap (--mlock pins them "
                "in RAM)"]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ResidencySettings:
        return cls(mlock=args.mlock, no_mmap=args.no_mmap, load_mode=args.load_mode)


def add_residency_args(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    g = parser.add_argument_group("weights in memory")
    return [
        g.add_argument("--mlock", action="store_true", help="pin the mapped weights in RAM"),
        g.add_argument("--no-mmap", action="store_true"),
        g.add_argument("-lm", "--load-mode", choices=list(LOAD_MODES), default=ResidencySettings().load_mode,
                       help="llama-server's loading mode: mlock and mmap+mlock pin the weights as --mlock; none "
                            "and dio are --no-mmap"),
    ]
