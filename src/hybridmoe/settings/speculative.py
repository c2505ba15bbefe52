"""Speculative decoding settings: llama-server's `--spec-type` and its `ngram-simple` sizes."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from hybridmoe.settings.values import require

# llama-server's --spec-type values. The n-gram ones need no second model; the others draft with one.
NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
DRAFT_MODEL_TYPES = ("draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark")
MAX_DRAFT = 64  # the sliding-window KV ring's slack: a rejected draft can always be rolled back


@dataclass(frozen=True)
class SpeculativeSettings:
    """ngram: propose the tokens that followed the latest earlier occurrence of the last `size_n`
    tokens (up to `size_m`, cut to what the measured step costs make worth it), when that n-gram
    occurred at least `min_hits` times. Off by default, as in llama-server."""

    ngram: bool = False
    size_n: int = 12
    size_m: int = 48
    min_hits: int = 1

    def __post_init__(self) -> None:
        require(self.size_n >= 1, "--spec-ngram-simple-size-n", "be >= 1", self.size_n)
        require(1 <= self.size_m <= MAX_DRAFT, "--spec-ngram-simple-size-m", f"be in 1..{MAX_DRAFT}", self.size_m)
        require(self.min_hits >= 1, "--spec-ngram-simple-min-hits", "be >= 1", self.min_hits)

    @property
    def enabled(self) -> bool:
        return self.ngram

    @property
    def type_name(self) -> str:
        return "ngram-simple" if self.ngram else "none"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SpeculativeSettings:
        types = parse_spec_types(args.spec_type)
        ngram = args.spec_default or any(t in NGRAM_TYPES for t in types)
        return cls(ngram=ngram, size_n=args.spec_ngram_simple_size_n,
                   size_m=args.spec_ngram_simple_size_m, min_hits=args.spec_ngram_simple_min_hits)


def parse_spec_types(value: str) -> list[str]:
    """The comma-separated --spec-type list; an unknown name is an error, as in llama-server."""
    names = [t.strip() for t in value.split(",") if t.strip()]
    known = ("none",) + NGRAM_TYPES + DRAFT_MODEL_TYPES
    for t in names:
        if t not in known:
            raise argparse.ArgumentTypeError(f"unknown speculative type {t!r}; one of {', '.join(known)}")
    return names


def spec_type_notes(value: str, spec_default: bool = False) -> list[str]:
    """Warnings for --spec-type values (and --spec-default) served differently from llama-server."""
    notes = ["--spec-default (llama-server: ngram-mod) is served as ngram-simple"] if spec_default else []
    for t in parse_spec_types(value):
        if t in DRAFT_MODEL_TYPES:
            notes.append(f"--spec-type {t}: drafting with a second model is not supported; ignored")
        elif t in NGRAM_TYPES and t != "ngram-simple":
            notes.append(f"--spec-type {t}: served as ngram-simple (drafts from the sequence's own history)")
    return notes


def _spec_type(value: str) -> str:
    parse_spec_types(value)
    return value


def add_speculative_args(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    d = SpeculativeSettings()
    g = parser.add_argument_group("speculative decoding")
    return [
        g.add_argument("--spec-type", type=_spec_type, default="none", metavar="TYPES",
                       help="none, or ngram-simple: draft from the sequence's own history (comma-separated "
                            "llama-server names; the other ngram-* are served as ngram-simple)"),
        g.add_argument("--spec-default", action="store_true",
                       help="llama-server's default speculative setup; here ngram-simple"),
        g.add_argument("--spec-ngram-simple-size-n", type=int, default=d.size_n, metavar="N",
                       help=f"tokens that must repeat before a draft is proposed (default {d.size_n})"),
        g.add_argument("--spec-ngram-simple-size-m", type=int, default=d.size_m, metavar="M",
                       help=f"most tokens drafted (default {d.size_m}, at most {MAX_DRAFT}); each draft is cut "
                            "to the length the measured step times make worth feeding"),
        g.add_argument("--spec-ngram-simple-min-hits", type=int, default=d.min_hits, metavar="N",
                       help=f"earlier occurrences needed (default {d.min_hits})"),
    ]
