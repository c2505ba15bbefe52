"""Placement rules: device names, tensor kinds, and the regex overrides behind -ot / --cpu-moe.

The rules mirror llama.cpp's meaning (docs/placement.md):
`-ot REGEX=DEVICE` is a regex *search* on the tensor name, the first matching rule wins, and the
`--cpu-moe` / `--n-cpu-moe` shortcuts are just more overrides appended after the user's `-ot`s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CPU = "cpu"

# Expert weights AND biases (the pattern is unanchored on the right, so `.bias` matches too).
# `(ch|)` keeps llama.cpp's spelling for the chunked-expert variant of some architectures.
EXPERT_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


class PlacementError(ValueError):
    """A placement option or plan that cannot work; the message names the bad value."""


# Tensor kinds used in the byte accounting.
KIND_ATTENTION = "attention"  # q/k/v/o projection weights
KIND_EXPERTS = "experts"  # routed expert weights and their biases (they move together)
KIND_ROUTER = "router"  # ffn_gate_inp weight + bias
KIND_NORMS_BIASES = "norms_biases"  # RMSNorm gains, attention biases, sinks
KIND_EMBEDDING = "embedding"  # token_embd (always on the CPU: a row gather per token)
KIND_OUTPUT = "output"  # the untied output head
KIND_OTHER = "other"
KINDS = (KIND_ATTENTION, KIND_EXPERTS, KIND_ROUTER, KIND_NORMS_BIASES, KIND_EMBEDDING,
         KIND_OUTPUT, KIND_OTHER)

_LAYER_RE = re.compile(r"^blk\.(\d+)\.")
_EXPERT_RE = re.compile(EXPERT_REGEX)
_ATTN_WEIGHT_RE = re.compile(r"\.attn_(q|k|v|qkv|output)\.weight$")
_ATTN_BIAS_RE = re.compile(r"\.attn_(q|k|v|qkv|output)\.bias$")


def normalize_device(spec: str, gpu_device: str = "cuda:0") -> str:
    """Canonical device string for `spec`: 'cpu' or 'cuda:N'.

    Accepts our spellings (`cpu`, `cuda`, `cuda:N`) and llama.cpp's buffer-type names (`CPU`,
    `CUDA0`, `CUDA1`, ...), case-insensitively. A bare `cuda` means `gpu_device`. llama.cpp's
    `CUDA_Host` (pinned host memory) is host RAM, so it maps to `cpu`.
    """
    s = spec.strip()
    low = s.lower()
    if low in ("cpu", "cuda_host"):
        return CPU
    if low == "cuda":
        return normalize_device(gpu_device) if gpu_device.strip().lower() != "cuda" else "cuda:0"
    m = re.fullmatch(r"cuda:?(\d+)", low)
    if m:
        return f"cuda:{int(m.group(1))}"
    raise PlacementError(
        f"unknown device {spec!r}: use cpu, cuda, cuda:N (or llama.cpp's CPU, CUDA0, CUDA1, ...)")


@dataclass(frozen=True)
class Rule:
    """One override: tensors whose name matches `pattern` (regex search) go to `device`."""

    pattern: re.Pattern[str]
    device: str
    source: str  # where it came from, shown in the plan (e.g. "-ot", "--cpu-moe")

    def matches(self, name: str) -> bool:
        return self.pattern.search(name) is not None

    def describe(self) -> str:
        return f"{self.source} {self.pattern.pattern}={self.device}"


def _compile(regex: str, where: str) -> re.Pattern[str]:
    if not regex:
        raise PlacementError(f"{where}: empty regex")
    try:
        return re.compile(regex)
    except re.error as e:
        raise PlacementError(f"{where}: invalid regex {regex!r}: {e}") from None


def parse_overrides(specs: list[str] | tuple[str, ...], gpu_device: str = "cuda:0") -> list[Rule]:
    """Parse `-ot` values, each "REGEX=DEVICE[,REGEX=DEVICE...]", into rules in the given order.

    The split is on the LAST '=' of each comma-separated item, so a regex may contain '='; a regex
    cannot contain ',' (same limitation as llama.cpp's parser).
    """
    rules: list[Rule] = []
    for spec in specs:
        for item in spec.split(","):
            item = item.strip()
            if not item:
                continue
            regex, sep, dev = item.rpartition("=")
            if not sep:
                raise PlacementError(f"-ot {item!r}: expected REGEX=DEVICE (e.g. 'exps=CPU')")
            where = f"-ot {item!r}"
            try:
                device = normalize_device(dev, gpu_device)
            except PlacementError as e:
                raise PlacementError(f"{where}: {e}") from None
            rules.append(Rule(_compile(regex, where), device, "-ot"))
    return rules


def cpu_moe_rules() -> list[Rule]:
    """`--cpu-moe`: the experts (weights and biases) of every layer stay on the CPU."""
    return [Rule(re.compile(EXPERT_REGEX), CPU, "--cpu-moe")]


def n_cpu_moe_rules(n: int) -> list[Rule]:
    """`--n-cpu-moe N`: the experts of layers 0..N-1 stay on the CPU (llama.cpp: lowest indices)."""
    if n < 0:
        raise PlacementError(f"--n-cpu-moe must be >= 0, got {n}")
    return [Rule(re.compile(rf"blk\.{i}{EXPERT_REGEX}"), CPU, "--n-cpu-moe") for i in range(n)]


def first_match(rules: list[Rule], name: str) -> Rule | None:
    for rule in rules:
        if rule.matches(name):
            return rule
    return None


def tensor_layer(name: str) -> int | None:
    """Block index of a `blk.N.*` tensor, else None (embedding, output head, output norm)."""
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def tensor_kind(name: str) -> str:
    """Accounting kind of a GGUF tensor name (llama.cpp's gpt-oss names)."""
    if name.startswith("token_embd."):
        return KIND_EMBEDDING
    if name == "output.weight" or name == "output.bias":
        return KIND_OUTPUT
    if _EXPERT_RE.search(name):
        return KIND_EXPERTS
    if ".ffn_gate_inp." in name:
        return KIND_ROUTER
    if _ATTN_WEIGHT_RE.search(name):
        return KIND_ATTENTION
    if _ATTN_BIAS_RE.search(name) or "_norm." in name or ".attn_sinks." in name:
        return KIND_NORMS_BIASES
    return KIND_OTHER
