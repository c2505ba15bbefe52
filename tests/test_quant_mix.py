"""quant_mix: llama-quantize's per-tensor type rules as they apply to gpt-oss.

The expected tables below are written out by hand from llama.cpp's rules (not computed from
quant_mix), so a change to the data table shows up here. With HYBRIDMOE_LLAMA_QUANTIZE pointing at
a llama-quantize binary, its --dry-run is compared tensor by tensor as well.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import gguf
import pytest

from hybridmoe import quant_mix
from hybridmoe.gguf.constants import GGMLType as T
from hybridmoe.gguf.reader import open_model
from hybridmoe.quant_mix import LOW_BIT_FALLBACK, MIXES, fallback, file_type_number, ftype_name, more_bits, type_for
from hybridmoe.synth import PRESETS, write_synthetic

LLAMA_QUANTIZE = os.environ.get("HYBRIDMOE_LLAMA_QUANTIZE", "")

# 20b shapes (ne, innermost first).
H, Q, KV, E, N = 2880, 4096, 512, 32, 24
NE = {"token_embd": (H, 201088), "output": (H, 201088), "attn_q": (H, Q), "attn_k": (H, KV),
      "attn_v": (H, KV), "attn_output": (Q, H), "ffn_gate_exps": (H, H, E), "ffn_up_exps": (H, H, E),
      "ffn_down_exps": (H, H, E)}
MORE_BITS_20B = {0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23}

# ftype -> role -> type in a 20b file, experts as --quantized-experts writes them.
# "A|B@S": A in the layers of set S, B elsewhere.
EXPECTED_20B = {
    #          embd     output  attn_q/k  attn_v             attn_output gate/up   down
    "MXFP4_MOE": ("Q8_0", "Q8_0", "Q8_0", "Q8_0", "Q8_0", "MXFP4", "MXFP4"),
    "F16": ("F16", "F16", "F16", "F16", "F16", "F16", "F16"),
    "Q8_0": ("Q8_0", "Q8_0", "Q8_0", "Q8_0", "Q8_0", "Q8_0", "Q8_0"),
    "Q4_0": ("Q4_0", "Q8_0", "Q4_0", "Q4_0", "Q4_0", "Q4_0", "Q4_0"),
    "Q4_1": ("Q4_1", "Q8_0", "Q4_1", "Q4_1", "Q4_1", "Q4_1", "Q4_1"),
    "Q5_0": ("Q5_0", "Q8_0", "Q5_0", "Q5_0", "Q5_0", "Q5_0", "Q5_0"),
    "Q5_1": ("Q5_1", "Q8_0", "Q5_1", "Q5_1", "Q5_1", "Q5_1", "Q5_1"),
    "Q2_K": ("Q4_0", "Q8_0", "Q4_0", "Q5_0", "Q3_K", "Q4_0", "Q4_0"),
    "Q3_K_S": ("Q4_0", "Q8_0", "Q4_0", "Q4_0", "Q3_K", "Q4_0", "Q4_0"),
    "Q3_K_M": ("Q4_0", "Q8_0", "Q4_0", "Q5_1|Q5_0@first2", "Q4_K", "Q4_0", "Q5_1|Q5_0@first1"),
    "Q3_K_L": ("Q4_0", "Q8_0", "Q4_0", "Q5_1", "Q5_K", "Q4_0", "Q5_1"),
    "Q4_K_S": ("Q5_0", "Q8_0", "Q5_0", "Q5_1|Q5_0@first4", "Q4_K", "Q5_0", "Q5_1|Q5_0@first3"),
    "Q4_K_M": ("Q5_0", "Q8_0", "Q5_0", "Q8_0|Q5_0@more", "Q4_K", "Q5_0", "Q8_0|Q5_0@more"),
    "Q5_K_S": ("Q5_1", "Q8_0", "Q5_1", "Q5_1", "Q5_K", "Q5_1", "Q5_1"),
    "Q5_K_M": ("Q5_1", "Q8_0", "Q5_1", "Q8_0|Q5_1@more", "Q5_K", "Q5_1", "Q8_0|Q5_1@more"),
    "Q6_K": ("Q8_0", "Q8_0", "Q8_0", "Q8_0", "Q6_K", "Q8_0", "Q8_0"),
    "IQ4_NL": ("IQ4_NL", "Q8_0", "IQ4_NL", "Q5_1", "IQ4_NL", "IQ4_NL", "Q5_1|IQ4_NL@first3"),
    "IQ4_XS": ("IQ4_NL", "Q8_0", "IQ4_NL", "Q5_1", "IQ4_XS", "IQ4_NL", "Q5_1|IQ4_NL@first3"),
}
LAYER_SETS = {"more": MORE_BITS_20B, **{f"first{k}": set(range(k)) for k in range(1, 5)}}


def _expected(cell: str, layer: int) -> T:
    if "|" not in cell:
        return T[cell]
    bumped, rest = cell.split("|")
    base, where = rest.split("@")
    return T[bumped if layer in LAYER_SETS[where] else base]


@pytest.mark.parametrize("ftype", EXPECTED_20B)
def test_20b_types_per_ftype(ftype):
    embd, output, qk, v, o, gate_up, down = EXPECTED_20B[ftype]
    assert type_for("token_embd.weight", NE["token_embd"], N, ftype, True) == T[embd]
    assert type_for("output.weight", NE["output"], N, ftype, True) == T[output]
    for i in range(N):
        cells = {"attn_q": qk, "attn_k": qk, "attn_v": v, "attn_output": o,
                 "ffn_gate_exps": gate_up, "ffn_up_exps": gate_up, "ffn_down_exps": down}
        for role, cell in cells.items():
            got = type_for(f"blk.{i}.{role}.weight", NE[role], N, ftype, quantized_experts=True)
            assert got == _expected(cell, i), (ftype, i, role)
            if role.endswith("_exps"):  # published files: experts stay as released
                assert type_for(f"blk.{i}.{role}.weight", NE[role], N, ftype) == T.MXFP4


@pytest.mark.parametrize("ftype", MIXES)
def test_unquantized_tensors_stay_f32(ftype):
    for name, ne in [("blk.0.attn_norm.weight", (H,)), ("blk.0.post_attention_norm.weight", (H,)),
                     ("output_norm.weight", (H,)), ("blk.0.attn_sinks.weight", (64,)),
                     ("blk.0.ffn_gate_inp.weight", (H, E)), ("blk.0.ffn_gate_inp.bias", (E,)),
                     ("blk.0.attn_q.bias", (Q,)), ("blk.0.ffn_down_exps.bias", (H, E))]:
        assert type_for(name, ne, N, ftype, quantized_experts=True) == T.F32, (ftype, name)


def test_published_20b_q4_k_m_counts(tmp_path):
    """The public gpt-oss-20b Q4_K_M GGUF's tensor type counts, from a sparse (header-only) file."""
    path = write_synthetic(tmp_path / "q4km.gguf", "20b", sparse=True, ftype="q4_k_m")
    m = open_model(path)
    counts = Counter(info.ggml_type for info in m.tensors.values())
    assert counts == {T.F32: 289, T.Q5_0: 61, T.Q8_0: 13, T.Q4_K: 24, T.MXFP4: 72}
    assert m.metadata["general.file_type"] == 15
    m.close()


def test_more_bits_layers():
    assert {i for i in range(24) if more_bits(i, 24)} == MORE_BITS_20B
    assert {i for i in range(36) if more_bits(i, 36)} == {0, 1, 2, 3, *range(6, 31, 3), 31, 32, 33, 34, 35}


@pytest.mark.parametrize("target, rows, want", [
    (T.Q4_K, 2880, T.Q5_0), (T.Q4_K, 4096, T.Q4_K), (T.Q5_K, 2880, T.Q5_1), (T.Q6_K, 2880, T.Q8_0),
    (T.Q2_K, 2880, LOW_BIT_FALLBACK), (T.Q3_K, 2880, LOW_BIT_FALLBACK), (T.IQ4_XS, 2880, T.IQ4_NL),
    (T.IQ2_XXS, 2880, T.IQ4_NL), (T.Q8_0, 2880, T.Q8_0), (T.F16, 2881, T.F16),
    (T.Q4_K, 48, T.F16), (T.Q8_0, 48, T.F16),  # no block fits: llama-quantize writes F16
])
def test_row_size_fallback(target, rows, want):
    assert fallback(target, rows) == want


@pytest.mark.parametrize("ftype", MIXES)
def test_file_type_numbers_match_gguf_py(ftype):
    assert file_type_number(ftype) == gguf.LlamaFileType[f"MOSTLY_{ftype}"]


def test_ftype_names():
    assert ftype_name("q4_k_m") == "Q4_K_M" and ftype_name(" Mxfp4_Moe ") == "MXFP4_MOE"
    with pytest.raises(ValueError, match="choose from MXFP4_MOE, F16, Q8_0"):
        ftype_name("Q4_K_X")


def test_rules_module_is_torch_free():
    """synth, inspect and tools read the rules without model code: hybridmoe.gguf only, no torch."""
    tree = ast.parse(Path(quant_mix.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in imported if m.startswith("hybridmoe")} <= {"hybridmoe.gguf.constants"}
    code = "import sys, hybridmoe.quant_mix; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# llama-quantize --dry-run prints one line per tensor: "name - [ne...], type = src, size = ... (new)".
_DRY_RUN_LINE = re.compile(r"\]\s+(\S+)\s+- \[([\d,\s]+)\], type =\s+(\w+), size =.*?(?:\((\w+)\))?$")


@pytest.mark.skipif(not (LLAMA_QUANTIZE and Path(LLAMA_QUANTIZE).is_file()),
                    reason="no llama-quantize binary: set HYBRIDMOE_LLAMA_QUANTIZE to build/bin/llama-quantize")
@pytest.mark.parametrize("preset", ["20b", "tiny256"])
def test_llama_quantize_dry_run_agrees(tmp_path, preset):
    """From an F16 file (experts F16 too: a fine-tune), llama-quantize's choice for every tensor and
    every ftype equals type_for with quantized experts. Sparse source: nothing is read."""
    src = write_synthetic(tmp_path / "f16.gguf", preset, sparse=True, ftype="F16", quantized_experts=True)
    n_layers = PRESETS[preset].config.n_layers
    for ftype in MIXES:
        if ftype == "F16":
            continue
        out = subprocess.run([LLAMA_QUANTIZE, "--dry-run", src, str(tmp_path / "out.gguf"), ftype, "1"],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        seen = 0
        for line in (out.stdout + out.stderr).splitlines():
            if m := _DRY_RUN_LINE.search(line):
                name, ne_text, cur, new = m.groups()
                ne = tuple(int(x) for x in ne_text.split(","))
                while len(ne) > 1 and ne[-1] == 1:
                    ne = ne[:-1]
                assert type_for(name, ne, n_layers, ftype, True).name == (new or cur).upper(), (ftype, name)
                seen += 1
        assert seen == len(open_model(src).tensors)
