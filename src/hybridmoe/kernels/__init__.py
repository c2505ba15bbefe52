"""Python face of the C++ CPU kernels (csrc/, through ctypes), with a torch fallback.

Every tensor is checked here (dtype, shape, strides, device) once per call; the C side trusts
the pointers it gets. Weights stay where they are (GGUF mmap views): nothing is copied or repacked.
The names below are this package's API; Activations live in kernels.activations, the thread and
crossover settings in kernels.tuning, the library and its block types in kernels._lib.

    available() -> bool            the compiled library loaded (else: kernels.reference, torch)
    isa() -> str                   "avx512" | "avx2" | "scalar" | "torch"
    set_isa(name)                  force a variant ("auto" = best supported); env HYBRIDMOE_ISA
    set_num_threads(n)             size of the persistent worker pool (default: physical cores,
                                   or env HYBRIDMOE_THREADS); num_threads() reads it
    set_gemv_max_tokens(n)         tokens per expert up to which the streaming GEMV is used
                                   (fp32, per format and kernel set: MXFP4 48 on AVX-512, 14 on
                                   AVX2, Q8_0 16; fast_math=True: fast mode's, 2; None: the
                                   defaults); gemv_max_tokens(ggml_type) reads them
    Activations                    FP32 (default) | INT16 | INT8X3 | INT8 (fast math): every matmul entry
                                   point takes one per call (`act=`), so each model has its own
    ExpertTensors                  one layer's routed experts (mmap views)
    moe_forward(...)               fused gpt-oss MoE layer
    linear_q8_0 / linear_mxfp4     x @ W^T (+ bias) for quantized dense weights; LinearGroup
    linear_quantized(x, w, t)      the same for any KERNEL_TYPES type (EXT_TYPES: decoded rows, fp32)
    dequantize(raw, ggml_type)     float32 copy through the kernels' own decoder (tests, tools)
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridmoe.gguf.constants import BLOCK_SIZES, GGMLType
from hybridmoe.kernels import _lib, reference
from hybridmoe.kernels._lib import BLOCK_BYTES, EXT_TYPES, KERNEL_TYPES, LIB, NATIVE_TYPES, WHY_MISSING
from hybridmoe.kernels.activations import ACT16_REL_ERR, INT8X3_REL_ERR, Activations, act_code
from hybridmoe.kernels.tuning import gemv_max_tokens, num_threads, physical_cores, set_gemv_max_tokens, set_num_threads

log = logging.getLogger(__name__)

__all__ = [
    "ACT16_REL_ERR", "INT8X3_REL_ERR", "Activations", "ExpertTensors", "LinearGroup", "available", "dequantize", "isa",
    "EXT_TYPES", "KERNEL_TYPES", "digits_active", "gemv_max_tokens", "linear_mxfp4", "linear_q8_0",
    "linear_quantized", "moe_forward", "num_threads",
    "set_gemv_max_tokens", "set_isa", "set_num_threads",
]

_ISAS = ("avx512", "avx2", "scalar")
_warned = False


def _warn_fallback() -> None:
    global _warned
    if not _warned:
        log.warning("hybridmoe C++ kernels unavailable (%s); using the slow torch reference", WHY_MISSING)
        _warned = True


def available() -> bool:
    """True when the compiled kernel library is loaded."""
    return LIB is not None


def isa() -> str:
    """The kernel variant in use: "avx512", "avx2", "scalar", or "torch" (no library)."""
    return LIB.hm_get_isa().decode() if LIB else "torch"


def set_isa(name: str) -> None:
    """Force a kernel variant ("avx512", "avx2", "scalar") or pick the best one ("auto")."""
    if LIB is None:
        raise RuntimeError(f"no compiled kernels to choose from: {WHY_MISSING}")
    if name == "auto":
        for cand in _ISAS:
            if LIB.hm_isa_supported(cand.encode()) and _self_check(cand):
                return
        raise RuntimeError("no kernel variant passed its self-check")  # scalar always should
    if name not in _ISAS:
        raise ValueError(f"unknown ISA {name!r}; choose one of {', '.join(_ISAS)} or 'auto'")
    rc = LIB.hm_set_isa(name.encode())
    if rc == _lib.ERR_BAD_ISA:
        raise ValueError(f"this CPU does not support the {name} kernels")
    if rc:
        raise RuntimeError(f"hm_set_isa({name}) failed: {rc}")


def digits_active() -> bool:
    """True when Activations.INT8X3 runs the three-digit GEMV on this ISA (else it computes fp32)."""
    return LIB is not None and bool(LIB.hm_d3_active())


# ----------------------------------------------------------------------------- pointer helpers
def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _f32(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"{name} must be a float32 CPU torch.Tensor, got "
                         f"{getattr(t, 'dtype', type(t))} on {getattr(t, 'device', '?')}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    return t.contiguous()


def _weight_rows(w: np.ndarray, name: str, ggml_type: GGMLType, n_rows: int | None, k: int | None
                 ) -> tuple[int, int, int]:
    """Checks a 2-D quantized matrix view; returns (n_rows, K, row_stride_bytes)."""
    if not isinstance(w, np.ndarray) or w.dtype != np.uint8 or w.ndim != 2:
        raise ValueError(f"{name} must be a 2-D uint8 numpy array (rows x row bytes), got "
                         f"{type(w).__name__} {getattr(w, 'dtype', '')} ndim={getattr(w, 'ndim', '?')}")
    bb = BLOCK_BYTES[ggml_type]
    if w.shape[1] % bb:
        raise ValueError(f"{name}: row of {w.shape[1]} bytes is not a whole number of {ggml_type.name} blocks")
    if w.strides[1] != 1 or w.strides[0] < w.shape[1]:
        raise ValueError(f"{name}: rows must be contiguous bytes, got strides {w.strides}")
    rows, kk = w.shape[0], w.shape[1] // bb * BLOCK_SIZES[ggml_type][0]
    if n_rows is not None and rows != n_rows:
        raise ValueError(f"{name} has {rows} rows, expected {n_rows}")
    if k is not None and kk != k:
        raise ValueError(f"{name} has {kk} inputs per row, expected {k}")
    return rows, kk, w.strides[0]


# ----------------------------------------------------------------------------- experts
@dataclass(eq=False)
class ExpertTensors:
    """One layer's routed experts as views into the GGUF mmap (no copies).

    gate, up: uint8 [E, I, H/32*block_bytes]; down: uint8 [E, H, I/32*block_bytes]. Rows must be
    contiguous; the E axis may have any stride (e.g. the two halves of a fused gate_up tensor).
    Biases: float32 [E, I] (gate, up) and [E, H] (down), or None.
    """

    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    gate_bias: torch.Tensor | None
    up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    ggml_type: GGMLType
    down_type: GGMLType | None = None  # None: the same as gate / up
    _cargs: tuple | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.ggml_type = GGMLType(self.ggml_type)
        self.down_type = self.ggml_type if self.down_type is None else GGMLType(self.down_type)
        for name in ("gate", "up", "down"):
            a = getattr(self, name)
            if not isinstance(a, np.ndarray) or a.dtype != np.uint8 or a.ndim != 3:
                raise ValueError(f"ExpertTensors.{name} must be a uint8 numpy array [E, rows, row_bytes]")
        if self.gate.shape != self.up.shape:
            raise ValueError(f"gate {self.gate.shape} and up {self.up.shape} shapes differ")
        if self.down.shape[0] != self.gate.shape[0]:
            raise ValueError(f"down has {self.down.shape[0]} experts, gate has {self.gate.shape[0]}")

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]

    def dims(self) -> tuple[int, int]:
        """(H, I): hidden size (down rows) and expert intermediate size (gate rows)."""
        return self.down.shape[1], self.gate.shape[1]

    def c_args(self) -> tuple:
        """Checked pointers for hm_moe_forward, computed once (the views must outlive this object)."""
        if self._cargs is None:
            t, td = self.ggml_type, self.down_type
            for tt in (t, td):
                if tt not in BLOCK_BYTES:
                    raise ValueError(f"no C kernel for expert type {tt.name}")
            E = self.num_experts
            H, I = self.dims()
            args = []
            for name, rows, k, typ in (("gate", I, H, t), ("up", I, H, t), ("down", H, I, td)):
                a = getattr(self, name)
                _weight_rows(a[0], f"ExpertTensors.{name}[0]", typ, rows, k)
                args += [_addr(a), a.strides[0] if E > 1 else 0]
            biases = []
            for name, rows in (("gate_bias", I), ("up_bias", I), ("down_bias", H)):
                b = getattr(self, name)
                if b is not None:
                    b = _f32(b, f"ExpertTensors.{name}", (E, rows))
                    setattr(self, name, b)  # keep the contiguous copy alive
                biases.append(b.data_ptr() if b is not None else None)
            self._cargs = (E, I, int(t), int(td), *args, *biases)
        return self._cargs


def _check_routing(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, H: int) -> tuple:
    if x.dim() != 2 or x.shape[1] != H:
        raise ValueError(f"x must be [T, {H}], got {tuple(x.shape)}")
    x = _f32(x, "x", tuple(x.shape))
    if ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"expert_ids must be [T={x.shape[0]}, k], got {tuple(ids.shape)}")
    if ids.dtype not in (torch.int32, torch.int64) or ids.device.type != "cpu":
        raise ValueError(f"expert_ids must be int32 on the CPU, got {ids.dtype} on {ids.device}")
    ids = ids.to(torch.int32).contiguous()
    wts = _f32(wts, "expert_weights", tuple(ids.shape))
    return x, ids, wts


def moe_forward(x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
                experts: ExpertTensors, swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
                act: Activations = Activations.FP32) -> torch.Tensor:
    """gpt-oss routed experts for all T tokens of a step, each expert's weights read once.

    x [T, H] f32, expert_ids [T, k] int32 (int64 accepted), expert_weights [T, k] f32 -> [T, H] f32:
    out[t] = sum_j w[t,j] * (down_e(swiglu(gate_e(x[t]) + bg, up_e(x[t]) + bu)) + bd), e = ids[t,j].
    """
    mode = act_code(act)
    H, _ = experts.dims()
    x, ids, wts = _check_routing(x, expert_ids, expert_weights, H)
    if LIB is None or experts.ggml_type not in BLOCK_BYTES or experts.down_type not in BLOCK_BYTES:
        if LIB is None:
            _warn_fallback()
        return reference.moe_forward(x, ids, wts, experts, swiglu_alpha, swiglu_limit)
    out = torch.empty_like(x)
    E, I, fmt, dfmt, g, gs, u, us, d, ds, gb, ub, db = experts.c_args()
    rc = LIB.hm_moe_forward(x.data_ptr(), x.shape[0], H, ids.data_ptr(), wts.data_ptr(),
                                    ids.shape[1], E, I, fmt, dfmt, g, gs, u, us, d, ds, gb, ub, db,
                                    swiglu_alpha, swiglu_limit, out.data_ptr(), mode)
    if rc == _lib.ERR_BAD_EXPERT:
        bad = ids[(ids < 0) | (ids >= E)]
        raise ValueError(f"expert_ids out of range [0, {E}): {bad[:8].tolist()}")
    if rc:
        raise RuntimeError(f"hm_moe_forward failed with code {rc}")
    return out


class MoeBlock:
    """A whole gpt-oss MoE block in one kernel call: x + experts(h), h = rms_norm(x) * norm_w, routed
    to the top-k of h @ router_w^T + router_b (ties to the lower id), softmax over those k. The
    weights are checked once here and their pointers kept (a decode step calls it once per layer).

    norm_w [H], router_w [E, H], router_b [E] float32 CPU; `supports(experts)` says whether it can
    run. Calling it with x [T, H] float32 gives [T, H]; `routing_out` (ids int32, weights float32,
    [T, k]) receives the routing.
    """

    @staticmethod
    def supports(experts: ExpertTensors) -> bool:
        """The library is loaded and has kernels for these expert types."""
        return LIB is not None and experts.ggml_type in BLOCK_BYTES and experts.down_type in BLOCK_BYTES

    def __init__(self, norm_w: torch.Tensor, eps: float, router_w: torch.Tensor, router_b: torch.Tensor | None,
                 k: int, experts: ExpertTensors, swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
                 act: Activations = Activations.FP32):
        if not self.supports(experts):
            raise RuntimeError("MoeBlock needs the kernel library and expert types it multiplies")
        self.hidden, E = experts.dims()[0], experts.num_experts
        if not 1 <= k <= E:
            raise ValueError(f"MoeBlock: k = {k} experts per token, the layer has {E}")
        self.k = k
        self._keep = [t.contiguous() for t in (norm_w, router_w) + ((router_b,) if router_b is not None else ())]
        ptrs = [_cpu_f32(self._keep[0], "norm_w", self.hidden), _cpu_f32(self._keep[1], "router_w", E * self.hidden),
                _cpu_f32(self._keep[2], "router_b", E) if router_b is not None else None]
        _, I, fmt, dfmt, g, gs, u, us, d, ds, gb, ub, db = experts.c_args()
        self._experts = experts  # keeps the views behind the pointers alive
        self._args = (ptrs[0], eps, ptrs[1], ptrs[2], k, E, I, fmt, dfmt, g, gs, u, us, d, ds, gb, ub, db,
                      swiglu_alpha, swiglu_limit)
        self._mode = act_code(act)

    def __call__(self, x: torch.Tensor, routing_out: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x must be [T, {self.hidden}], got {tuple(x.shape)}")
        x = _f32(x, "x", tuple(x.shape))
        T, ids_p, wts_p = x.shape[0], None, None
        if routing_out is not None:
            ids, wts = routing_out
            if ids.dtype != torch.int32 or tuple(ids.shape) != (T, self.k) or not ids.is_contiguous():
                raise ValueError(f"routing_out ids must be a contiguous int32 [{T}, {self.k}] tensor")
            ids_p, wts_p = ids.data_ptr(), _cpu_f32(wts, "routing_out weights", T * self.k)
        out = torch.empty_like(x)
        a = self._args
        rc = LIB.hm_moe_block(x.data_ptr(), T, self.hidden, *a, out.data_ptr(), self._mode, ids_p, wts_p)
        if rc:
            raise ValueError(f"moe_block: bad arguments (x {tuple(x.shape)}, k {self.k}), code {rc}")
        return out


# ----------------------------------------------------------------------------- dense
def _linear(x: torch.Tensor, w: np.ndarray, bias: torch.Tensor | None, t: GGMLType,
            act: Activations = Activations.FP32) -> torch.Tensor:
    mode = act_code(act)
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D [T, K] tensor, got {getattr(x, 'shape', type(x))}")
    N, K, stride = _weight_rows(w, "w", t, None, x.shape[1])
    x = _f32(x, "x", tuple(x.shape))
    if bias is not None:
        bias = _f32(bias, "bias", (N,))
    if LIB is None:
        _warn_fallback()
        return reference.linear(x, w, t, bias)
    out = torch.empty((x.shape[0], N), dtype=torch.float32)
    rc = LIB.hm_linear(int(t), x.data_ptr(), x.shape[0], K, _addr(w), N, stride,
                               bias.data_ptr() if bias is not None else None, out.data_ptr(), mode)
    if rc:
        raise RuntimeError(f"hm_linear failed with code {rc}")
    return out


class LinearGroup:
    """Quantized matrices that read the same input (a layer's q, k, v), computed in one kernel
    call: one input preparation, one pass of the pool. Weights and biases are checked once here,
    their pointers kept, so a decode step pays one short call instead of one per matrix.

    `group(x)` with x [T, K] float32 -> [T, sum N_i] float32, matrix i in columns
    offsets[i]..offsets[i+1]-1 (split it with `torch.split(y, sizes, dim=1)`).
    """

    def __init__(self, weights: list[np.ndarray], biases: list[torch.Tensor | None], ggml_type: GGMLType,
                 act: Activations = Activations.FP32):
        self._mode = act_code(act)
        if not 1 <= len(weights) <= 8 or len(biases) != len(weights):
            raise ValueError(f"LinearGroup takes 1..8 weights with one bias entry each, got "
                             f"{len(weights)} weights and {len(biases)} biases")
        self.ggml_type = GGMLType(ggml_type)
        shapes = [_weight_rows(w, f"weights[{i}]", self.ggml_type, None, None) for i, w in enumerate(weights)]
        ks = {k for _, k, _ in shapes}
        if len(ks) != 1:
            raise ValueError(f"LinearGroup weights must share the input size, got {sorted(ks)}")
        self.in_features = ks.pop()
        self.sizes = [n for n, _, _ in shapes]
        self.out_features = sum(self.sizes)
        self._weights = weights  # keep the views (and their mmap) alive
        self._biases = [None if b is None else _f32(b, f"biases[{i}]", (n,)) for i, (b, n) in
                        enumerate(zip(biases, self.sizes))]
        n = len(weights)
        self._n = n
        self._ws = (ctypes.c_void_p * n)(*[_addr(w) for w in weights])
        self._Ns = (ctypes.c_int64 * n)(*self.sizes)
        self._strides = (ctypes.c_int64 * n)(*[st for _, _, st in shapes])
        self._bs = (ctypes.c_void_p * n)(*[None if b is None else b.data_ptr() for b in self._biases])
        self._ldos = (ctypes.c_int64 * n)(*([self.out_features] * n))
        self._outs = (ctypes.c_void_p * n)()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"x must be [T, {self.in_features}], got {tuple(x.shape)}")
        x = _f32(x, "x", tuple(x.shape))
        if LIB is None:
            _warn_fallback()
            return torch.cat([reference.linear(x, w, self.ggml_type, b) for w, b in
                              zip(self._weights, self._biases)], dim=1)
        out = torch.empty((x.shape[0], self.out_features), dtype=torch.float32)
        base, col = out.data_ptr(), 0
        for i, n in enumerate(self.sizes):
            self._outs[i] = base + 4 * col
            col += n
        rc = LIB.hm_linear_multi(int(self.ggml_type), x.data_ptr(), x.shape[0], self.in_features,
                                         self._n, self._ws, self._Ns, self._strides, self._bs, self._outs,
                                         self._ldos, self._mode)
        if rc:
            raise RuntimeError(f"hm_linear_multi failed with code {rc}")
        return out


def linear_q8_0(x: torch.Tensor, w: np.ndarray, bias: torch.Tensor | None = None,
                act: Activations = Activations.FP32) -> torch.Tensor:
    """x [T, K] f32 @ W^T (+ bias [N]) -> [T, N] f32; W uint8 [N, K/32*34] Q8_0 (e.g. mmap view)."""
    return _linear(x, w, bias, GGMLType.Q8_0, act)


def linear_quantized(x: torch.Tensor, w: np.ndarray, ggml_type: GGMLType, bias: torch.Tensor | None = None,
                     act: Activations = Activations.FP32) -> torch.Tensor:
    """x [T, K] f32 @ W^T (+ bias [N]) -> [T, N] f32 for W uint8 [N, row_bytes] of any KERNEL_TYPES
    type (ext types compute in fp32 whatever `act` says)."""
    t = GGMLType(ggml_type)
    if t not in BLOCK_BYTES:
        raise ValueError(f"no C kernel for type {t.name} (kernel types: {', '.join(k.name for k in KERNEL_TYPES)})")
    return _linear(x, w, bias, t, act)


def linear_mxfp4(x: torch.Tensor, w: np.ndarray, bias: torch.Tensor | None = None,
                 act: Activations = Activations.FP32) -> torch.Tensor:
    """x [T, K] f32 @ W^T (+ bias [N]) -> [T, N] f32; W uint8 [N, K/32*17] MXFP4."""
    return _linear(x, w, bias, GGMLType.MXFP4, act)


# ----------------------------------------------------------------------------- attention
def _cpu_f32(t: torch.Tensor, name: str, numel: int | None = None) -> int:
    """Pointer of a contiguous float32 CPU tensor (attribute checks only: this is the decode hot path)."""
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous float32 CPU tensor, got {t.dtype} on {t.device}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, expected {numel}")
    return t.data_ptr()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n] float32 CPU -> x / sqrt(mean(x^2) + eps) * weight [n] (sum of squares in double)."""
    n = weight.numel()
    if x.shape[-1] != n:
        raise ValueError(f"rms_norm: x has {x.shape[-1]} features, weight {n}")
    if LIB is None:
        _warn_fallback()
        return torch.nn.functional.rms_norm(x.float(), (n,), weight.float(), eps)
    x = x.contiguous()
    out = torch.empty_like(x)
    rc = LIB.hm_rms_norm(_cpu_f32(x, "x"), x.numel() // n, n, _cpu_f32(weight, "weight", n), eps,
                                 out.data_ptr())
    if rc:
        raise ValueError(f"rms_norm: bad arguments (shape {tuple(x.shape)})")
    return out


def attn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None,
                sin: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor, row: int,
                kpos: torch.Tensor | None, pos: int, n_keys: int, window: int, sinks: torch.Tensor,
                scale: float) -> torch.Tensor:
    """Attention step of one new token of one sequence, in place on its float32 KV cache.

    q [Hq, d], k/v [Hkv, d] (float32, contiguous; q and k are roped in place with cos/sin [d] as
    `RopeTable.cos_sin` gives, or not at all when None). k, v go to `row` of k_cache/v_cache
    [Hkv, rows, d]; a ring layer passes kpos [rows] int64 (absolute position per row, -1
    empty), which gets kpos[row] = pos. Returns [Hq, d]: softmax attention over rows
    0..n_keys-1 (full layer: all visible; ring: 0 <= kpos <= pos, kpos > pos - window when
    window > 0) with one sink logit per query head (sinks [Hq]).
    """
    if LIB is None:
        raise RuntimeError("attn_decode needs the compiled kernels (kernels.available() is False); "
                           "use layers.attention_with_sinks")
    Hkv, rows, d = k_cache.shape
    Hq = q.numel() // d
    out = torch.empty((Hq, d), dtype=torch.float32)
    if kpos is not None and (kpos.dtype != torch.int64 or not kpos.is_contiguous() or kpos.numel() != rows):
        raise ValueError(f"kpos must be a contiguous int64 tensor of {rows} rows")
    if tuple(v_cache.shape) != (Hkv, rows, d):
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)}, expected {(Hkv, rows, d)}")
    rc = LIB.hm_attn_decode(
        _cpu_f32(q, "q", Hq * d), _cpu_f32(k, "k", Hkv * d), _cpu_f32(v, "v", Hkv * d), Hq, Hkv, d,
        None if cos is None else _cpu_f32(cos, "cos", d), None if sin is None else _cpu_f32(sin, "sin", d),
        _cpu_f32(k_cache, "k_cache"), _cpu_f32(v_cache, "v_cache"), rows, row,
        None if kpos is None else kpos.data_ptr(), pos, n_keys, window, _cpu_f32(sinks, "sinks", Hq),
        scale, out.data_ptr())
    if rc:
        raise ValueError(f"attn_decode: bad arguments (Hq={Hq}, Hkv={Hkv}, d={d}, rows={rows}, "
                         f"row={row}, n_keys={n_keys}, pos={pos}, window={window})")
    return out


def dequantize(raw: np.ndarray, ggml_type: GGMLType | int) -> np.ndarray:
    """uint8 [..., row_bytes] -> float32 [..., K] through the current ISA's decoder (bit-exact)."""
    t = GGMLType(ggml_type)
    if LIB is None or t not in BLOCK_BYTES:
        return reference.dequant(raw, t).numpy()
    flat = raw.reshape(-1, raw.shape[-1]) if raw.ndim != 2 else raw
    n, K, stride = _weight_rows(flat, "raw", t, None, None)
    out = np.empty((n, K), dtype=np.float32)
    if LIB.hm_dequant(int(t), _addr(flat), n, stride, K, _addr(out)):
        raise RuntimeError("hm_dequant failed")
    return out.reshape(*raw.shape[:-1], K)


# ----------------------------------------------------------------------------- start-up
def _self_check(name: str) -> bool:
    """Selects `name` if it agrees with the scalar kernels on small random problems (both formats,
    GEMV and tile paths); guards against a SIMD variant never run on this kind of CPU."""
    rng = np.random.default_rng(0)
    weights = []
    for t in NATIVE_TYPES:
        bb = BLOCK_BYTES[t]
        w = rng.integers(0, 256, size=(13, 4 * bb), dtype=np.uint8)
        if t == GGMLType.MXFP4:
            w[:, ::17] = rng.integers(118, 130, size=(13, 4), dtype=np.uint8)  # sane e8m0 scales
        else:
            w.reshape(13, 4, bb)[:, :, :2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
        weights.append((t, w))
    x = torch.from_numpy(rng.standard_normal((40, 128), dtype=np.float32))
    results = []
    for variant in ("scalar", name):
        LIB.hm_set_isa(variant.encode())
        results.append([_linear(x[:n], w, None, t) for t, w in weights for n in (1, 5, 40)])
    ok = all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(*results))
    if not ok:
        log.warning("hybridmoe %s kernels disagree with the scalar reference; not using them", name)
        LIB.hm_set_isa(b"scalar")
    return ok


def _init() -> None:
    if LIB is None:
        _warn_fallback()
        return
    forced = os.environ.get("HYBRIDMOE_ISA", "auto")
    set_isa(forced)
    set_num_threads(int(os.environ.get("HYBRIDMOE_THREADS", 0) or physical_cores()))


_init()
