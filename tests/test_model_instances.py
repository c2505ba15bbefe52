"""Settings and buffers belong to a model instance: two models in one process compute each their
own way (fast math on one, exact on the other), and a model's staging buffers go with it."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from hybridmoe import kernels
from hybridmoe.gguf.constants import GGMLType
from hybridmoe.gguf.reader import open_model
from hybridmoe.kernels import reference
from hybridmoe.models.device_options import DeviceOptions
from hybridmoe.models.experts_cpu import RouteBuffers
from hybridmoe.models.gpt_oss import SWIGLU_ALPHA, SWIGLU_LIMIT, GptOss, SeqChunk
from hybridmoe.placement.expert_backends import STAGED, STREAMED
from tests.hf_reference import build_pair
from tests.model_helpers import AlwaysStream, rebuild_experts

EXACT_ERR = 1e-5  # fp32 activations: vs transformers (tests/test_gpt_oss_vs_hf.py) and kernels.reference
# int8 activations (kernels.Activations.INT8): ~5e-3 relative error per matmul, ~1e-2 through a
# MoE layer (tests/kernels/test_fast_math.py's bounds); above FAST_MIN, the int8 path really ran.
LINEAR_FAST_TOL, MOE_FAST_TOL, FAST_MIN = 2e-2, 3e-2, 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all(), "NaN/inf in logits"
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("instances") / "q8.gguf"
    hf = build_pair(path, seed=3, layers=4, heads=8, kv_heads=2, experts=8, top_k=4, window=32,
                    dense_type=GGMLType.Q8_0)  # Q8_0 dense: the C GEMV takes the model's mode too
    return hf, str(path)


@pytest.mark.skipif(not kernels.available(), reason="fast math is a mode of the compiled kernels")
@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")  # reference reads the mmap
def test_fast_and_exact_models_in_one_process(hf_pair):
    hf, path = hf_pair
    mf = open_model(path)
    exact, fast = GptOss(mf), GptOss(mf, fast_math=True)
    assert (exact.activations, fast.activations) == (kernels.Activations.FP32, kernels.Activations.INT8)
    # Per layer, against the plain-torch twin: the exact model to fp32 rounding, the fast one
    # within the int8 error and clearly off it.
    g = torch.Generator().manual_seed(5)
    h = torch.randn(6, exact.config.hidden, generator=g)
    ids = torch.stack([torch.randperm(exact.config.n_experts, generator=g)[:4] for _ in range(6)]).int()
    w = torch.softmax(torch.randn(6, 4, generator=g), -1)
    experts = exact.layers[0].moe.experts.experts
    moe_ref = reference.moe_forward(h, ids, w, experts, SWIGLU_ALPHA, SWIGLU_LIMIT)
    assert rel_err(exact.layers[0].moe.experts(h, ids, w), moe_ref) < EXACT_ERR
    assert FAST_MIN < rel_err(fast.layers[0].moe.experts(h, ids, w), moe_ref) < MOE_FAST_TOL
    head_ref = reference.linear(h, np.array(exact.output.raw), GGMLType.Q8_0)
    assert rel_err(exact.output(h), head_ref) < EXACT_ERR
    assert FAST_MIN < rel_err(fast.output(h), head_ref) < LINEAR_FAST_TOL
    # Whole models, decode steps interleaved call by call: the exact one matches transformers
    # and gives the same bits as when it runs alone; the fast one differs (routing near-ties of
    # this random model flip on some tokens, so only its typical row is bounded).
    tokens = torch.randint(0, exact.config.vocab_size, (48,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(tokens[None]).logits[0].float()
    caches = {m: m.make_cache(len(tokens)) for m in (exact, fast)}
    rows: dict[GptOss, list[torch.Tensor]] = {exact: [], fast: []}
    for t in tokens.tolist():
        for m in (exact, fast):
            rows[m].append(m.forward([SeqChunk(caches[m], [t])])[0])
    got_exact, got_fast = torch.stack(rows[exact]), torch.stack(rows[fast])
    assert rel_err(got_exact, ref) < EXACT_ERR
    per_row = (got_fast - ref).abs().max(1).values / ref.abs().max(1).values
    assert FAST_MIN < per_row.median().item() < 0.1
    assert (got_fast.argmax(1) == ref.argmax(1)).float().mean().item() >= 0.75
    alone = exact.make_cache(len(tokens))
    assert torch.equal(torch.stack([exact.forward([SeqChunk(alone, [t])])[0] for t in tokens.tolist()]),
                       got_exact)


def _with_staged_layers(path: str) -> GptOss:
    model = GptOss(open_model(path))
    rebuild_experts(model, 0, STAGED)
    rebuild_experts(model, 1, STREAMED, DeviceOptions(cost=AlwaysStream()))
    model.forward([SeqChunk(model.make_cache(16), list(range(1, 9)))])
    return model


def test_buffers_are_per_model_and_freed_with_it(tiny_gguf):
    a, b = _with_staged_layers(tiny_gguf), _with_staged_layers(tiny_gguf)
    assert a.buffers is not b.buffers
    routes = [v for v in a.buffers._items.values() if isinstance(v, RouteBuffers)]
    assert len(routes) == 1 and len(a.buffers) >= 3  # route buffers, upload buffers, device sync
    gone = [weakref.ref(a), weakref.ref(a.buffers), weakref.ref(routes[0].packed)]
    del a, routes
    gc.collect()
    assert all(r() is None for r in gone)
    out = b.forward([SeqChunk(b.make_cache(16), list(range(1, 9)))])  # the other model is untouched
    assert torch.isfinite(out).all()
