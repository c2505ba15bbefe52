"""Files in the type mixes people download (llama-quantize's ftypes) against transformers' float32
reference run on the same dequantized weights: the default path within its stated error, the
same argmax; --fast-math within its own bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridmoe import LLM, ComputeSettings, kernels
from hybridmoe.gguf.reader import open_model
from hybridmoe.kernels import reference
from hybridmoe.quant.formats import Q8_0_EXACT_TYPES
from hybridmoe.models.gpt_oss import SWIGLU_ALPHA, SWIGLU_LIMIT, GptOss, SeqChunk
from hybridmoe.quant_mix import type_for
from tests.hf_reference import build_pair

# 20b-like at a tiny size: rows of 64 (as gpt-oss's 2880, not a multiple of 256, so attn_q/k/v,
# the embedding, the head and the experts take llama-quantize's block-32 fallbacks) and
# attn_output rows of heads * head_dim = 256 (as gpt-oss's 4096: a real K-quant).
SHAPE = dict(layers=8, heads=16, kv_heads=4, head_dim=16, experts=8, top_k=4, window=24, hidden=64, ffn=64)
FTYPES = ["Q4_K_M", "Q4_K_S", "Q5_K_M", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_M",
          "IQ4_NL", "IQ4_XS"]
CASES = [(f, False) for f in FTYPES] + [("Q4_K_M", True), ("Q8_0", True), ("Q5_K_M", True)]
N_POS = 72  # past the sliding window
STATED_ERR = 1e-5  # the default path (fp32 activations), as tests/test_gpt_oss_vs_hf.py
# Per matmul (tests/test_model_instances.py): exact to fp32 rounding; int8 activations ~5e-3 per
# GEMV, ~1e-2 through a MoE layer; above FAST_MIN the int8 path really ran.
EXACT_ERR, LINEAR_FAST_TOL, MOE_FAST_TOL, FAST_MIN = 1e-5, 2e-2, 3e-2, 1e-4


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    assert np.isfinite(a).all() and np.isfinite(b).all(), "NaN/inf in logits"
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c[0] + ("-experts" if c[1] else ""))
def case(request, tmp_path_factory):
    ftype, experts = request.param
    path = tmp_path_factory.mktemp("mix") / f"{ftype}.gguf"
    hf = build_pair(path, seed=5, **SHAPE,
                    type_for=lambda name, ne: type_for(name, ne, SHAPE["layers"], ftype, experts))
    return hf, path, ftype, experts


def test_file_holds_the_mix(case):
    _, path, ftype, experts = case
    with open_model(path) as mf:
        types = {name: info.ggml_type for name, info in mf.tensors.items()}
    for name, t in types.items():
        assert t == type_for(name, mf.tensors[name].ne, SHAPE["layers"], ftype, experts), name
    if ftype.startswith(("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_XS")):
        # the one real K-quant of gpt-oss files, and the block-32 fallbacks around it
        assert types["blk.0.attn_output.weight"].name != types["blk.0.attn_q.weight"].name
    if experts:
        assert types["blk.0.ffn_gate_exps.weight"].name != "MXFP4"


def test_logits_match_transformers(case):
    hf, path, _, _ = case
    llm = LLM(path, compute=ComputeSettings(threads=1))
    ids = torch.randint(0, llm.config.vocab_size, (N_POS,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float().numpy()
    ours = llm.logits(ids.tolist())
    err = rel_err(ours, ref)
    assert err < STATED_ERR, f"relative error {err:.2e}"
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_decode_path_matches_transformers(case):
    """One token per forward: the GEMV path of every matmul (the prompt test above takes the tile
    path for most of them)."""
    hf, path, _, _ = case
    llm = LLM(path, compute=ComputeSettings(threads=1))
    ids = torch.randint(0, llm.config.vocab_size, (40,), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float().numpy()
    cache = llm.model.make_cache(len(ids))
    ours = torch.cat([llm.model.forward([SeqChunk(cache, [t])]) for t in ids.tolist()]).numpy()
    assert rel_err(ours, ref) < STATED_ERR
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_fast_math_within_its_stated_error(case):
    """--fast-math, matmul by matmul against the plain-torch reference on the file's weights:
    int8 activations where the weights are Q8_0 or MXFP4 (the Q4_0 / Q5_0 / IQ4_NL matrices are
    held as Q8_0, so they take it too) within the stated int8 error; the other types compute fp32,
    so they stay exact."""
    if not kernels.available():
        pytest.skip("C kernels not built: fast mode is a kernel feature")
    _, path, _, _ = case
    mf = open_model(path)
    exact, fast = GptOss(mf), GptOss(mf, fast_math=True)
    g = torch.Generator().manual_seed(5)
    h = torch.randn(3, exact.config.hidden, generator=g)
    a = torch.randn(3, exact.config.n_heads * exact.config.head_dim, generator=g)
    for i in (0, 1):  # attn_v differs between these layers in the "more bits" mixes
        checks = [(exact.layers[i].attention.o, fast.layers[i].attention.o, a)]
        for ours, theirs, x in checks + [(exact.output, fast.output, h)]:
            ref = reference.linear(x, np.array(ours.raw), ours.ggml_type, ours.bias)
            assert rel_err(ours(x).numpy(), ref.numpy()) < EXACT_ERR
            err = rel_err(theirs(x).numpy(), ref.numpy())
            if ours.ggml_type in kernels.EXT_TYPES:
                assert err < EXACT_ERR, ours.name
            else:
                assert FAST_MIN < err < LINEAR_FAST_TOL, ours.name
        ids = torch.stack([torch.randperm(exact.config.n_experts, generator=g)[:4] for _ in range(3)]).int()
        w = torch.softmax(torch.randn(3, 4, generator=g), -1)
        ex = exact.layers[i].moe.experts.experts
        ref = reference.moe_forward(h, ids, w, ex, SWIGLU_ALPHA, SWIGLU_LIMIT)
        err = rel_err(fast.layers[i].moe.experts(h, ids, w).numpy(), ref.numpy())
        if ex.ggml_type == ex.down_type and ex.ggml_type not in kernels.EXT_TYPES:
            assert FAST_MIN < err < MOE_FAST_TOL, ex.ggml_type
        else:  # block types without int8 kernels, or two formats in one layer: fp32
            assert err < EXACT_ERR, (ex.ggml_type, ex.down_type)
        qkv = [mf.tensors[f"blk.{i}.attn_{p}.weight"].ggml_type for p in "qkv"]
        err = rel_err(fast.layers[i].attention.qkv(h).numpy(), exact.layers[i].attention.qkv(h).numpy())
        assert err < (EXACT_ERR if set(qkv) <= set(kernels.EXT_TYPES) - set(Q8_0_EXACT_TYPES) else LINEAR_FAST_TOL)
