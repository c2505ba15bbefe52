"""Which ggml type each gpt-oss tensor has in a file of a given llama.cpp file type (ftype).

llama-quantize picks a tensor's type from the ftype, the tensor's role and its layer, then demotes a
256-element-block type whose rows do not fit. Published gpt-oss GGUFs follow those rules, so files
written with them have the real files' type mix and sizes. Written here as data (`MIXES`) plus the
one demotion function (`fallback`); `type_for` is the single entry point. Torch-free on purpose:
`synth`, `inspect` and tests read it without loading any model code.

Facts from llama.cpp's src/llama-quant.cpp as they apply to gpt-oss (32 or 128 experts, 8 query
heads per KV head, no importance matrix); see docs/formats.md, "Type mixes of published files".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from hybridmoe.gguf.constants import BLOCK_SIZES, GGMLType

T = GGMLType

# The 32-block type that Q2_K and Q3_K become when rows are not a multiple of 256. Current llama.cpp
# uses Q4_0; builds of 2025 used IQ4_NL. One place to change if a file of the other era is needed.
LOW_BIT_FALLBACK = T.Q4_0

# 256-block type -> the 32-block type llama-quantize uses instead when rows are not a multiple of 256.
_FALLBACKS: dict[GGMLType, GGMLType] = {
    T.Q2_K: LOW_BIT_FALLBACK,
    T.Q3_K: LOW_BIT_FALLBACK,
    T.Q4_K: T.Q5_0,
    T.Q5_K: T.Q5_1,
    T.Q6_K: T.Q8_0,
    T.TQ1_0: T.Q4_0,
    T.TQ2_0: T.Q4_0,
    **{t: T.IQ4_NL for t in (T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_XS)},
}

EXPERT_ROLES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's "use more bits" layers: the first and last eighth and every third one between,
    where the K-quant mixes spend extra bits on attn_v and ffn_down."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def first_layers(k: int) -> Callable[[int, int], bool]:
    """Layers 0..k-1 (llama.cpp counts attn_v tensors; gpt-oss has one per layer)."""
    return lambda i, n: i < k


def first_fraction(d: int) -> Callable[[int, int], bool]:
    """Layers below n // d: the first eighth or sixteenth of the model."""
    return lambda i, n: i < n // d


@dataclass(frozen=True)
class Bump:
    """A layer-dependent upgrade: type `to` in the layers where `when(i, n_layers)` holds."""

    to: GGMLType
    when: Callable[[int, int], bool]


@dataclass(frozen=True)
class Mix:
    """One ftype's target types (before the row-size fallback); None means `base`."""

    file_type: int  # general.file_type: llama.cpp's LLAMA_FTYPE_MOSTLY_* number
    base: GGMLType  # token_embd, attn_q, attn_k, ffn_gate/up experts, and what None falls back to
    output: GGMLType  # output.weight (llama-quantize gives the head Q6_K, which falls back to Q8_0)
    attn_v: GGMLType | None = None
    attn_v_bump: Bump | None = None
    attn_output: GGMLType | None = None
    ffn_down: GGMLType | None = None
    ffn_down_bump: Bump | None = None
    experts: GGMLType | None = None  # all three expert tensors, whatever else says (MXFP4_MOE)


_MORE = Bump(T.Q6_K, more_bits)

# Targets per ftype. Rows of 2880 (everything but attn_output in gpt-oss) demote 256-block types by
# `fallback`, so e.g. Q4_K_M's Q4_K embedding is Q5_0 in the file; see tests/test_quant_mix.py for
# the resulting 20b table.
MIXES: dict[str, Mix] = {
    # ggml-org's release: experts MXFP4, every other weight Q8_0.
    "MXFP4_MOE": Mix(38, T.Q8_0, T.Q8_0, experts=T.MXFP4),
    "F16": Mix(1, T.F16, T.F16),
    "Q8_0": Mix(7, T.Q8_0, T.Q8_0),
    "Q4_0": Mix(2, T.Q4_0, T.Q6_K),
    "Q4_1": Mix(3, T.Q4_1, T.Q6_K),
    "Q5_0": Mix(8, T.Q5_0, T.Q6_K),
    "Q5_1": Mix(9, T.Q5_1, T.Q6_K),
    # attn_v: Q4_K because gpt-oss has >= 4 query heads per KV head.
    "Q2_K": Mix(10, T.Q2_K, T.Q6_K, attn_v=T.Q4_K, attn_output=T.Q3_K, ffn_down=T.Q3_K),
    "Q3_K_S": Mix(11, T.Q3_K, T.Q6_K),
    "Q3_K_M": Mix(12, T.Q3_K, T.Q6_K, attn_v=T.Q4_K, attn_v_bump=Bump(T.Q5_K, first_layers(2)),
                  attn_output=T.Q4_K, ffn_down=T.Q4_K, ffn_down_bump=Bump(T.Q5_K, first_fraction(16))),
    "Q3_K_L": Mix(13, T.Q3_K, T.Q6_K, attn_v=T.Q5_K, attn_output=T.Q5_K, ffn_down=T.Q5_K),
    "Q4_K_S": Mix(14, T.Q4_K, T.Q6_K, attn_v_bump=Bump(T.Q5_K, first_layers(4)),
                  ffn_down_bump=Bump(T.Q5_K, first_fraction(8))),
    "Q4_K_M": Mix(15, T.Q4_K, T.Q6_K, attn_v_bump=_MORE, ffn_down_bump=_MORE),
    "Q5_K_S": Mix(16, T.Q5_K, T.Q6_K),
    "Q5_K_M": Mix(17, T.Q5_K, T.Q6_K, attn_v_bump=_MORE, ffn_down_bump=_MORE),
    "Q6_K": Mix(18, T.Q6_K, T.Q6_K),
    # attn_v: Q5_K because of the >= 4 query heads per KV head; ffn_down: no importance matrix.
    "IQ4_NL": Mix(25, T.IQ4_NL, T.Q6_K, attn_v=T.Q5_K, ffn_down_bump=Bump(T.Q5_K, first_fraction(8))),
    "IQ4_XS": Mix(30, T.IQ4_XS, T.Q6_K, attn_v=T.Q5_K, ffn_down_bump=Bump(T.Q5_K, first_fraction(8))),
}

DEFAULT_FTYPE = "MXFP4_MOE"


def ftype_name(name: str) -> str:
    """The canonical ftype name for `name` (any case); ValueError listing the choices otherwise."""
    key = name.strip().upper()
    if key not in MIXES:
        raise ValueError(f"unknown file type {name!r}; choose from {', '.join(MIXES)}")
    return key


def file_type_number(ftype: str) -> int:
    """general.file_type for the ftype (llama.cpp's LLAMA_FTYPE_MOSTLY_* value)."""
    return MIXES[ftype_name(ftype)].file_type


def fallback(t: GGMLType, row_elems: int) -> GGMLType:
    """The type llama-quantize writes when target `t` meets rows of `row_elems`: `t` if the rows are
    a multiple of its block, else its 32-block stand-in, else F16 (a row no block type fits)."""
    if row_elems % BLOCK_SIZES[t][0] == 0:
        return t
    demoted = _FALLBACKS.get(t, t)
    return demoted if row_elems % BLOCK_SIZES[demoted][0] == 0 else T.F16


def is_quantizable(name: str, ne: tuple[int, ...]) -> bool:
    """Whether llama-quantize touches the tensor at all: 2-D/3-D weights, not norms nor the router."""
    return (len(ne) >= 2 and name.endswith("weight") and "_norm.weight" not in name
            and "ffn_gate_inp.weight" not in name)


_LAYER = re.compile(r"blk\.(\d+)\.([a-z_]+)\.weight$")


def _role(name: str) -> tuple[str, int]:
    """(role, layer) of a weight name; layer -1 for the global tensors."""
    if name in ("token_embd.weight", "output.weight"):
        return name.removesuffix(".weight"), -1
    m = _LAYER.match(name)
    return (m.group(2), int(m.group(1))) if m else ("other", -1)


def _bumped(t: GGMLType, bump: Bump | None, layer: int, n_layers: int) -> GGMLType:
    return bump.to if bump is not None and bump.when(layer, n_layers) else t


def target_type(name: str, n_layers: int, ftype: str) -> GGMLType:
    """The type the ftype's rules ask for, before the row-size fallback (quantizable tensors only)."""
    mix = MIXES[ftype_name(ftype)]
    role, layer = _role(name)
    if role == "output":
        return mix.output
    if role in EXPERT_ROLES and mix.experts is not None:
        return mix.experts
    if role == "attn_v":
        return _bumped(mix.attn_v or mix.base, mix.attn_v_bump, layer, n_layers)
    if role == "attn_output":
        return mix.attn_output or mix.base
    if role == "ffn_down_exps":
        return _bumped(mix.ffn_down or mix.base, mix.ffn_down_bump, layer, n_layers)
    return mix.base


def type_for(name: str, ne: tuple[int, ...], n_layers: int, ftype: str = DEFAULT_FTYPE,
             quantized_experts: bool = False) -> GGMLType:
    """The ggml type of tensor `name` (dims `ne`, innermost first) in an `ftype` gpt-oss file.

    Without `quantized_experts` the routed experts stay MXFP4, as in every published gpt-oss GGUF
    (quantized from the MXFP4 release); with it they follow the ftype's rules, as a fine-tune
    quantized from 16-bit weights would. Tensors llama-quantize never touches are F32.
    """
    if not is_quantizable(name, ne):
        return T.F32
    if not quantized_experts and _role(name)[0] in EXPERT_ROLES:
        return T.MXFP4
    return fallback(target_type(name, n_layers, ftype), ne[0])
