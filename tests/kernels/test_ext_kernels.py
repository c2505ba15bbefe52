"""The other ggml block types (kernels.EXT_TYPES) through the dense linear and the fused MoE, per
ISA, against float64 products of gguf-py's dequantized weights (an oracle independent of ours)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hybridmoe.kernels as K
from hybridmoe.gguf.constants import GGMLType, block_elems

from kernel_helpers import dequant64, isa_params, make_experts, moe_reference64, quantized, rel_err, routing

# Decoded values are exact; only the fp32 sums differ from float64 (observed ~1e-7..1e-6).
EXT_TOL = 1e-5
TYPES = [pytest.param(t, id=t.name) for t in K.EXT_TYPES]
MODES = [K.Activations.FP32, K.Activations.INT16, K.Activations.INT8X3, K.Activations.INT8]


def _k(t: GGMLType) -> int:
    return 512 if block_elems(t) == 256 else 96  # several blocks per row either way


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("T", [1, 3, 8, 9, 40])  # the GEMV path (<= 8 tokens), then the tile GEMM
def test_linear_matches_float64(isa, t, T, use_isa):
    use_isa(isa)
    rng = np.random.default_rng()
    N, Kd = 37, _k(t)  # an odd row count exercises the GEMV's partial row group
    w = quantized(rng, N, Kd, t)
    x = torch.from_numpy(rng.standard_normal((T, Kd), dtype=np.float32))
    b = torch.from_numpy(rng.standard_normal(N, dtype=np.float32))
    ref = x.double() @ dequant64(w, t).T + b.double()
    y = K.linear_quantized(x, w, t, b)
    assert y.shape == (T, N) and torch.isfinite(y).all()
    assert rel_err(y, ref) < EXT_TOL


@pytest.mark.parametrize("act", MODES, ids=lambda a: a.name)
def test_ext_types_compute_fp32_in_every_mode(act):
    """Ext types have no int8/int16 kernels: every mode gives the fp32 result, bit for bit."""
    rng = np.random.default_rng()
    t = GGMLType.Q4_K
    w = quantized(rng, 20, 512, t)
    x = torch.from_numpy(rng.standard_normal((2, 512), dtype=np.float32))
    assert torch.equal(K.linear_quantized(x, w, t, act=act), K.linear_quantized(x, w, t))


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("t,down", [(GGMLType.Q5_0, GGMLType.Q8_0), (GGMLType.Q4_K, GGMLType.Q6_K),
                                    (GGMLType.Q4_1, GGMLType.Q4_1), (GGMLType.IQ4_XS, GGMLType.Q3_K),
                                    (GGMLType.MXFP4, GGMLType.Q5_1)],
                         ids=lambda v: v.name)
@pytest.mark.parametrize("T,k", [(1, 4), (6, 2), (30, 4)])
def test_moe_with_quantized_experts(isa, t, down, T, k, use_isa):
    """Fine-tune-style experts: gate/up and down in (possibly different) block types."""
    use_isa(isa)
    rng = np.random.default_rng()
    H = I = 256 if 256 in (block_elems(t), block_elems(down)) else 96
    ex = make_experts(rng, 8, H, I, t, down_type=down)
    x = torch.from_numpy(rng.standard_normal((T, H), dtype=np.float32))
    ids, w = routing(rng, T, k, 8)
    y = K.moe_forward(x, ids, w, ex)
    assert torch.isfinite(y).all()
    assert rel_err(y, moe_reference64(x, ids, w, ex)) < EXT_TOL


def test_bad_row_size_is_refused():
    """A row that is not a whole number of 256-element blocks is a clear error, not a crash."""
    w = np.zeros((4, 144), dtype=np.uint8)  # one Q4_K block per row = 256 inputs
    with pytest.raises(ValueError, match="expected 256|inputs per row"):
        K.linear_quantized(torch.zeros(1, 128), w, GGMLType.Q4_K)
