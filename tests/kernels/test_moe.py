"""Fused gpt-oss MoE layer against the float64 ground truth and kernels.reference."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import hybridmoe.kernels as K
from hybridmoe.gguf.constants import GGMLType
from hybridmoe.kernels import reference
from hybridmoe.kernels._lib import LIB

from kernel_helpers import default_tol, isa_params, make_experts, moe_reference64, quantized, rel_err, routing

H, I = 128, 96  # small but multi-block; I != H catches transposed dims
MOE_TOL = 1e-5  # fp32 accumulate vs float64; observed ~1e-7..1e-6


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("T,k", [(1, 1), (1, 4), (5, 1), (5, 8), (37, 4), (37, 8)])
def test_moe_matches_float64(isa, T, k, use_isa, act_mode):
    use_isa(isa)
    rng = np.random.default_rng()
    ex = make_experts(rng, 16, H, I)
    x = torch.from_numpy(rng.standard_normal((T, H), dtype=np.float32))
    ids, w = routing(rng, T, k, 16)
    ref = moe_reference64(x, ids, w, ex)
    y = K.moe_forward(x, ids, w, ex, act=act_mode)
    assert y.shape == (T, H) and y.dtype == torch.float32
    assert rel_err(y, ref) < default_tol(MOE_TOL, act_mode)
    assert rel_err(reference.moe_forward(x, ids, w, ex), ref) < MOE_TOL


@pytest.mark.parametrize("crossover", [0, 3, 1000])
def test_moe_gemv_tile_crossover_and_empty_experts(crossover, use_isa, act_mode):
    """Skewed routing: one expert gets every token, some get one, most none; both paths mixed."""
    rng = np.random.default_rng()
    K.set_gemv_max_tokens(crossover)
    ex = make_experts(rng, 8, H, I, bias=False)
    T = 9
    ids = torch.zeros((T, 2), dtype=torch.int32)
    ids[:, 1] = torch.tensor([1, 1, 1, 1, 2, 2, 3, 3, 3], dtype=torch.int32)  # expert 0: 9 tokens
    w = torch.rand(T, 2)
    y = K.moe_forward(x := torch.randn(T, H), ids, w, ex, act=act_mode)
    assert rel_err(y, moe_reference64(x, ids, w, ex)) < default_tol(MOE_TOL, act_mode)


def test_moe_q8_0_experts(act_mode):
    rng = np.random.default_rng()
    ex = make_experts(rng, 4, H, I, t=GGMLType.Q8_0)
    x = torch.randn(3, H)
    ids, w = routing(rng, 3, 2, 4)
    y = K.moe_forward(x, ids, w, ex, act=act_mode)
    assert rel_err(y, moe_reference64(x, ids, w, ex)) < default_tol(MOE_TOL, act_mode)


def test_moe_fused_gate_up_halves_strided_along_e(act_mode):
    """gate/up as the two halves of one [E, 2I, bytes] tensor: strided along E, same result."""
    rng = np.random.default_rng()
    ex = make_experts(rng, 6, H, I)
    fused = np.ascontiguousarray(np.concatenate([ex.gate, ex.up], axis=1))  # [E, 2I, bytes]
    strided = K.ExpertTensors(fused[:, :I], fused[:, I:], ex.down, ex.gate_bias, ex.up_bias, ex.down_bias,
                              GGMLType.MXFP4)
    assert not strided.gate.flags.c_contiguous
    x = torch.randn(4, H)
    ids, w = routing(rng, 4, 3, 6)
    assert torch.equal(K.moe_forward(x, ids, w, strided, act=act_mode), K.moe_forward(x, ids, w, ex, act=act_mode))


def _guarded(data: np.ndarray) -> np.ndarray:
    """Copy of `data` whose last byte is followed by an inaccessible page: any over-read faults."""
    page = mmap.PAGESIZE
    n_pages = (data.nbytes + page - 1) // page + 1
    buf = mmap.mmap(-1, n_pages * page)
    arr = np.frombuffer(buf, dtype=np.uint8)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    guard = arr.__array_interface__["data"][0] + (n_pages - 1) * page
    start = (n_pages - 1) * page - data.nbytes
    view = arr[start : start + data.nbytes]
    view[:] = data.reshape(-1)
    assert libc.mprotect(guard, page, 0) == 0, os.strerror(ctypes.get_errno())  # PROT_NONE
    return view.reshape(data.shape)


@pytest.mark.parametrize("isa", isa_params())
def test_tensors_ending_at_an_unreadable_page(isa, use_isa):
    use_isa(isa)
    rng = np.random.default_rng()
    ex = make_experts(rng, 4, H, I)
    g = K.ExpertTensors(_guarded(ex.gate), _guarded(ex.up), _guarded(ex.down), ex.gate_bias, ex.up_bias,
                        ex.down_bias, GGMLType.MXFP4)
    for T in (1, 20):  # GEMV and tile paths, all experts incl. the last (at the guard page)
        x = torch.randn(T, H)
        ids = torch.tensor([[3, 0]] * T, dtype=torch.int32)
        w = torch.rand(T, 2)
        assert torch.equal(K.moe_forward(x, ids, w, g), K.moe_forward(x, ids, w, ex))
    wq = quantized(rng, 33, 64, GGMLType.Q8_0)
    for T in (1, 20):
        x = torch.randn(T, 64)
        assert torch.equal(K.linear_q8_0(x, _guarded(wq)), K.linear_q8_0(x, wq))


def test_tensor_at_end_of_mmapped_file(tmp_path):
    """A file whose last bytes are the last block of the down tensor, used through np.memmap."""
    rng = np.random.default_rng()
    ex = make_experts(rng, 3, H, I)
    path = tmp_path / "experts.bin"
    with open(path, "wb") as f:
        for a in (ex.gate, ex.up, ex.down):
            f.write(a.tobytes())
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    n_g, n_d = ex.gate.nbytes, ex.down.nbytes
    views = [mm[:n_g].reshape(ex.gate.shape), mm[n_g : 2 * n_g].reshape(ex.up.shape),
             mm[2 * n_g :].reshape(ex.down.shape)]
    assert 2 * n_g + n_d == os.path.getsize(path)
    mapped = K.ExpertTensors(*views, ex.gate_bias, ex.up_bias, ex.down_bias, GGMLType.MXFP4)
    x = torch.randn(2, H)
    ids = torch.tensor([[2, 1], [2, 0]], dtype=torch.int32)
    w = torch.rand(2, 2)
    assert torch.equal(K.moe_forward(x, ids, w, mapped), K.moe_forward(x, ids, w, ex))


def test_nan_propagates_never_clamped_away(act_mode):
    rng = np.random.default_rng()
    ex = make_experts(rng, 4, H, I)
    for T in (3, 30):  # GEMV and tile paths
        x = torch.randn(T, H)
        x[0, 7] = float("nan")
        ids = torch.tensor([[0, 1]] * T, dtype=torch.int32)
        w = torch.rand(T, 2)
        w[1, 0] = float("nan")
        y = K.moe_forward(x, ids, w, ex, act=act_mode)
        assert torch.isnan(y[0]).all() and torch.isnan(y[1]).all()
        assert torch.isfinite(y[2:]).all()
    # A NaN gate bias must survive min(g, limit) and clamp(u): the clamps must not eat it.
    gb = ex.gate_bias.clone()
    gb[2, 5] = float("nan")
    nan_ex = K.ExpertTensors(ex.gate, ex.up, ex.down, gb, ex.up_bias, ex.down_bias, GGMLType.MXFP4)
    y = K.moe_forward(torch.randn(1, H), torch.tensor([[2]], dtype=torch.int32), torch.ones(1, 1), nan_ex,
                      act=act_mode)
    assert torch.isnan(y).all()


def test_swiglu_reference_values():
    g = torch.tensor([1.0, 100.0, -100.0, 1.0, 1.0, float("nan")])
    u = torch.tensor([0.0, 0.0, 0.0, 50.0, -50.0, 0.0])
    a = reference.swiglu_oai(g, u)
    assert abs(a[0].item() - 0.8457957659) < 1e-6  # gpt-oss.md §4.2 sanity value
    assert abs(a[1].item() - 7.0 * torch.sigmoid(torch.tensor(7 * 1.702)).item()) < 1e-5  # gate capped
    assert abs(a[2].item()) < 1e-30  # no lower clamp on the gate: sigmoid(-170) ~ 0
    assert abs(a[3].item() - 0.8457957659 * 8) < 1e-5 and abs(a[4].item() - 0.8457957659 * -6) < 1e-5
    assert torch.isnan(a[5])


def test_threads_give_identical_results(use_isa, act_mode):
    rng = np.random.default_rng()
    ex = make_experts(rng, 8, H, I)
    x = torch.randn(19, H)
    ids, w = routing(rng, 19, 4, 8)
    K.set_num_threads(1)
    one = K.moe_forward(x, ids, w, ex, act=act_mode)
    K.set_num_threads(2)
    two = K.moe_forward(x, ids, w, ex, act=act_mode)
    assert torch.equal(one, two)


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("T,k", [(1, 4), (3, 2)])
def test_large_experts_take_long_units(isa, T, k, use_isa, act_mode):
    """Experts with H, I >= 768 (decode calls cut into 96-row units): close to float64, and the
    same bits at 1 and 2 threads."""
    use_isa(isa)
    rng = np.random.default_rng()
    ex = make_experts(rng, 4, 800, 768)
    x = torch.randn(T, 800)
    ids, w = routing(rng, T, k, 4)
    K.set_num_threads(1)
    one = K.moe_forward(x, ids, w, ex, act=act_mode)
    K.set_num_threads(2)
    assert torch.equal(one, K.moe_forward(x, ids, w, ex, act=act_mode))
    assert rel_err(one, moe_reference64(x, ids, w, ex)) < default_tol(MOE_TOL, act_mode)


def test_bad_inputs_are_named():
    rng = np.random.default_rng()
    ex = make_experts(rng, 4, H, I)
    x = torch.randn(2, H)
    w = torch.ones(2, 1)
    with pytest.raises(ValueError, match=r"expert_ids out of range \[0, 4\): \[4\]"):
        K.moe_forward(x, torch.tensor([[1], [4]], dtype=torch.int32), w, ex)
    with pytest.raises(ValueError, match="x must be"):
        K.moe_forward(torch.randn(2, H + 32), torch.zeros(2, 1, dtype=torch.int32), w, ex)
    with pytest.raises(ValueError, match="expert_weights"):
        K.moe_forward(x, torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 2), ex)
    with pytest.raises(ValueError, match="int32"):
        K.moe_forward(x, torch.zeros(2, 1), w, ex)
    with pytest.raises(ValueError, match="shapes differ"):
        K.ExpertTensors(ex.gate, ex.up[:, :32], ex.down, None, None, None, GGMLType.MXFP4)
    with pytest.raises(ValueError, match="gate_bias"):
        bad = K.ExpertTensors(ex.gate, ex.up, ex.down, torch.zeros(4, I + 1), None, None, GGMLType.MXFP4)
        K.moe_forward(x, torch.zeros(2, 1, dtype=torch.int32), w, bad)


def test_set_isa_and_threads_validation():
    with pytest.raises(ValueError, match="unknown ISA"):
        K.set_isa("sse9")
    with pytest.raises(ValueError, match="positive"):
        K.set_num_threads(0)
    if K.available():
        for name in ("scalar", "avx2", "avx512"):
            if not LIB.hm_isa_supported(name.encode()):
                with pytest.raises(ValueError, match="does not support"):
                    K.set_isa(name)


def test_forced_variants_report_themselves(use_isa):
    """HYBRIDMOE_ISA / set_isa really switch the code path (so the variant tests mean something)."""
    if not K.available():
        pytest.skip("compiled kernels not built")
    for name in ("scalar", "avx2", "avx512"):
        if LIB.hm_isa_supported(name.encode()):
            K.set_isa(name)
            assert K.isa() == name


def test_torch_fallback_without_library():
    code = (
        "import torch, numpy as np, hybridmoe.kernels as K\n"
        "from hybridmoe.gguf.constants import GGMLType\n"
        "assert not K.available() and K.isa() == 'torch'\n"
        "w = np.zeros((3, 34), np.uint8); w[:, 1] = 0x3c; w[:, 2:] = 1\n"  # d = 1.0, q = 1
        "y = K.linear_q8_0(torch.ones(1, 32), w)\n"
        "assert torch.equal(y, torch.full((1, 3), 32.0)), y\n"
        "print('ok')\n"
    )
    env = dict(os.environ, HYBRIDMOE_NO_KERNELS="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
    assert "torch reference" in r.stderr  # the one-time warning


def _swiglu64(g: np.ndarray, u: np.ndarray, gb, ub, alpha: float, limit: float) -> np.ndarray:
    # The bias adds in float32 as the kernel does them (near u = -1 their rounding dominates).
    g = (g + (np.float32(0) if gb is None else gb)).astype(np.float64)
    u = (u + (np.float32(0) if ub is None else ub)).astype(np.float64)
    g = np.where(g > limit, limit, g)  # NaN stays NaN
    u = np.where(u > limit, limit, np.where(u < -limit, -limit, u))
    with np.errstate(over="ignore", invalid="ignore"):
        return g / (1 + np.exp(-alpha * g)) * (u + 1)


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("n", [24, 29])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_swiglu_kernel_exact_across_isas_and_close_to_float64(isa, n, bias, use_isa):
    """The MoE's clamped SwiGLU (its own exp): every variant bit-identical to the scalar one, and
    per element within (|alpha g| + 8) * 2^-23 relative of float64 (exp's conditioning; ~1e-7 for
    |g| < 1, ~5e-6 where exp nears overflow) over gate values from -200 to +200 (exp overflowing
    to inf for gate < -51.9), NaN in gate or up giving NaN, and +-inf."""
    rng = np.random.default_rng()
    rows = 7
    g = (rng.standard_normal((rows, n)) * rng.choice([0.1, 3.0, 60.0], size=(rows, n))).astype(np.float32)
    u = (rng.standard_normal((rows, n)) * 6).astype(np.float32)
    g[0, :8] = [np.nan, np.inf, -np.inf, -51.8, -52.0, -200.0, 7.5, 0.0]
    u[1, 3] = np.nan
    gb = rng.standard_normal(n).astype(np.float32) if bias else None
    ub = rng.standard_normal(n).astype(np.float32) if bias else None

    def run(name: str) -> np.ndarray:
        use_isa(name)
        out = np.full((rows, n + 3), 9.0, np.float32)  # ldo > n: the pad must stay untouched
        rc = LIB.hm_swiglu(g.ctypes.data, u.ctypes.data, rows, n, gb.ctypes.data if bias else None,
                                     ub.ctypes.data if bias else None, 1.702, 7.0, out.ctypes.data, n + 3)
        assert rc == 0
        assert (out[:, n:] == 9.0).all()
        return out[:, :n]

    got, ref_bits = run(isa), run("scalar")
    same_nan = np.isnan(got) == np.isnan(ref_bits)
    assert same_nan.all() and np.array_equal(got.view(np.uint32)[~np.isnan(got)], ref_bits.view(np.uint32)[~np.isnan(got)])
    want = _swiglu64(g, u, gb, ub, 1.702, 7.0)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan) and nan[0, 0] and nan[1, 3]
    finite = np.isfinite(want)
    rel = np.abs(got[finite] - want[finite]) / np.maximum(np.abs(want[finite]), 1e-30)
    # exp's condition number is |x|: rounding x = -alpha * g to float32 alone costs |x| * 2^-24.
    x = np.abs(1.702 * np.minimum((g + (gb if bias else 0)).astype(np.float64), 7.0))[finite]
    assert (rel <= (x + 8) * 2.0**-23).all(), (rel.max(), x[rel.argmax()])
    assert np.array_equal(got[~finite & ~nan], want[~finite & ~nan])  # -inf * (u + 1) etc.


def block_reference64(x: torch.Tensor, norm_w: torch.Tensor, router_w: torch.Tensor, router_b: torch.Tensor,
                      k: int, ex: K.ExpertTensors) -> tuple[torch.Tensor, ...]:
    """The MoE block in float64 as the model's unfused path composes it: out, ids, weights, logits."""
    x64 = x.double()
    h = x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + 1e-5) * norm_w.double()
    logits = h @ router_w.double().T + router_b.double()
    vals, ids = torch.topk(logits, k, dim=-1)
    wts = torch.softmax(vals, dim=-1)
    return x64 + moe_reference64(h.float(), ids.to(torch.int32), wts.float(), ex).double(), ids, wts, logits


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("T,k", [(1, 4), (3, 2), (37, 4)])
def test_moe_block_matches_the_unfused_block(isa, T, k, use_isa, act_mode):
    """Norm, router, top-k/softmax, experts and residual in one call: the same routing as the
    float64 composition (fresh random inputs, checked for near ties) and the same output."""
    use_isa(isa)
    rng = np.random.default_rng()
    E = 16
    ex = make_experts(rng, E, H, I)
    x = torch.from_numpy(rng.standard_normal((T, H), dtype=np.float32)) * 3
    norm_w = torch.from_numpy(rng.uniform(0.5, 1.5, H).astype(np.float32))
    router_w = torch.from_numpy(rng.standard_normal((E, H), dtype=np.float32)) * 0.1
    router_b = torch.from_numpy(rng.standard_normal(E, dtype=np.float32)) * 0.1
    ref, ref_ids, ref_wts, logits = block_reference64(x, norm_w, router_w, router_b, k, ex)
    gaps = torch.sort(logits, dim=-1, descending=True).values
    assert (gaps[:, k - 1] - gaps[:, k]).min() > 1e-5, "near tie in the random router: rerun"
    ids, wts = torch.empty((T, k), dtype=torch.int32), torch.empty((T, k))
    out = K.MoeBlock(norm_w, 1e-5, router_w, router_b, k, ex, act=act_mode)(x, routing_out=(ids, wts))
    assert torch.equal(ids.long(), ref_ids)
    assert rel_err(wts, ref_wts.float()) < 1e-6
    assert not torch.isnan(out).any()
    assert rel_err(out, ref.float()) < default_tol(MOE_TOL, act_mode)


def test_moe_block_rejects_bad_arguments():
    rng = np.random.default_rng(0)
    ex = make_experts(rng, 4, H, I)
    x, norm_w, router_w = torch.randn(2, H), torch.ones(H), torch.randn(4, H)
    with pytest.raises(ValueError, match="router_w"):
        K.MoeBlock(norm_w, 1e-5, torch.randn(3, H), None, 2, ex)
    with pytest.raises(ValueError, match="k = 5"):
        K.MoeBlock(norm_w, 1e-5, router_w, None, 5, ex)
    block = K.MoeBlock(norm_w, 1e-5, router_w, None, 2, ex)
    with pytest.raises(ValueError, match="x must be"):
        block(torch.randn(2, H + 1))
    with pytest.raises(ValueError, match="routing_out ids"):
        block(x, routing_out=(torch.empty((2, 2), dtype=torch.int64), torch.empty(2, 2)))
    assert torch.isfinite(block(x)).all()
