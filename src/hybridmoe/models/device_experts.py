"""Routed experts computed with torch on the device that holds their raw blocks.

Used for experts resident on an accelerator (raw MXFP4 uploaded once, 4.25 bits/weight) and for
the hit experts a prompt batch streams up from the CPU (experts_streamed.ExpertStreamer). Both keep the
weights quantized in memory and decode only the experts the batch hits, a few at a time, to the
compute dtype. With float32 (the default, on CUDA too) the result equals the CPU kernels' to fp32
rounding (tests run it on the CPU); bf16 (--fast-math) is exact for the MXFP4 weights and rounds
the activations to 8 mantissa bits before each matmul (f32 accumulation), ~0.3% relative per matmul.

Shapes: T tokens, k experts per token, H hidden, I expert intermediate size, n experts held.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridmoe.gguf.constants import GGMLType
from hybridmoe.placement.expert_backends import RESIDENT
from hybridmoe.quant.formats import MXFP4_LUT2
from hybridmoe.quant.torch_dequant import dequantize_torch, e8m0_to_fp32_half_torch

# Decoded weights (+ decoder transients) alive at once on the device: a VRAM cost on top of the
# plan's compute buffers; 256 MiB holds one gpt-oss expert in bf16 (~175 MB with transients).
DEFAULT_DECODE_BUDGET_BYTES = 256 << 20


@dataclass
class RawExperts:
    """Raw blocks of n experts on one device; expert j of this set is row j of every tensor.

    gate, up: uint8 [n, I, H/32*bb]; down: uint8 [n, H, I/32*bb]; biases float32 [n, I] / [n, H].
    """

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_bias: torch.Tensor
    up_bias: torch.Tensor
    down_bias: torch.Tensor
    ggml_type: GGMLType
    down_type: GGMLType

    @property
    def dims(self) -> tuple[int, int]:
        """(H, I)."""
        return self.down.shape[1], self.gate.shape[1]


_LUT2 = torch.tensor(MXFP4_LUT2.tolist(), dtype=torch.float32)  # doubled E2M1 values
_LEAN_DTYPES = (torch.float32, torch.bfloat16)  # share float32's exponent range: scales exact
_LUTS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _lut(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    key = (device, dtype)
    if key not in _LUTS:
        _LUTS[key] = _LUT2.to(device=device, dtype=dtype)
    return _LUTS[key]


def decode(raw: torch.Tensor, t: GGMLType, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [..., row_bytes] -> dtype [..., K]. MXFP4 -> bf16 is exact (2-bit significands).

    MXFP4 into bf16/f32 goes straight to `dtype` (about 5 transient bytes per weight instead of
    ~20 through the float32 twin), which bounds the workspace of a chunk of decoded experts.
    """
    if t != GGMLType.MXFP4 or dtype not in _LEAN_DTYPES:
        return dequantize_torch(raw, t).to(dtype)
    b = raw.reshape(*raw.shape[:-1], -1, 17)
    scale = e8m0_to_fp32_half_torch(b[..., 0]).to(dtype).unsqueeze(-1)  # [..., nb, 1]
    qs = b[..., 1:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [..., nb, 32] uint8
    w = _lut(raw.device, dtype)[codes.int()]
    return w.mul_(scale).reshape(*raw.shape[:-1], -1)


@dataclass
class Grouping:
    """The routed (token, choice) pairs sorted by expert; computed where `ids` lives.

    pairs: [R] flat pair index (token * k + choice j) in expert order; tok: [R] token of each row;
    starts: n + 1 host ints, rows of expert e are starts[e]:starts[e + 1].
    """

    pairs: torch.Tensor
    tok: torch.Tensor
    starts: list[int]

    def hit(self) -> list[int]:
        return [e for e in range(len(self.starts) - 1) if self.starts[e + 1] > self.starts[e]]

    def to(self, device: torch.device) -> "Grouping":
        return Grouping(self.pairs.to(device), self.tok.to(device), self.starts)


def group_rows(ids: torch.Tensor, n: int) -> Grouping:
    """ids: [T, k] expert ids in 0..n-1 (-1 = not in this set). One sync when on a device."""
    k = ids.shape[1]
    flat = ids.reshape(-1).long()
    pairs = torch.nonzero(flat >= 0).squeeze(1)
    pairs = pairs[torch.argsort(flat[pairs], stable=True)]
    counts = torch.bincount(flat[pairs], minlength=n).tolist()
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    return Grouping(pairs, pairs // k, starts)


def _swiglu(g: torch.Tensor, u: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    g = g.clamp(max=limit)
    u = u.clamp(-limit, limit)
    return g * torch.sigmoid(alpha * g) * (u + 1)


def experts_per_decode(experts: RawExperts, dtype: torch.dtype, budget_bytes: int) -> int:
    """How many experts to decode at once: decoded bytes + the decoder's transients (uint8
    codes + int32 indices, ~5 B/weight) within `budget_bytes`."""
    H, I = experts.dims
    per_expert = 3 * H * I * (torch.empty((), dtype=dtype).element_size() + 5)
    return max(1, budget_bytes // per_expert)


def _select(experts: RawExperts, js: list[int]) -> tuple[torch.Tensor, ...]:
    """gate, up, down rows of experts js. A consecutive run (always, for upload buffers) is a
    slice: no index tensor to upload, hence no host-device sync inside the streaming loop."""
    parts = (experts.gate, experts.up, experts.down)
    if js == list(range(js[0], js[0] + len(js))):
        return tuple(p[js[0] : js[0] + len(js)] for p in parts)
    sel = torch.tensor(js, device=experts.gate.device)
    return tuple(p.index_select(0, sel) for p in parts)


def expert_rows(
    x: torch.Tensor,
    y: torch.Tensor,
    starts: list[int],
    experts: RawExperts,
    todo: list[tuple[int, int]],
    alpha: float,
    limit: float,
    dtype: torch.dtype,
    decode_budget_bytes: int = DEFAULT_DECODE_BUDGET_BYTES,
) -> None:
    """y[rows of e] = expert(x[rows of e]) + down bias, for each (e, j) in `todo`: e indexes
    `starts` (rows), j the expert's position in `experts`. x: [R, H] in dtype; y: [R, H] f32.
    Experts are decoded a few at a time (one decode launch per tensor per group)."""
    per = experts_per_decode(experts, dtype, decode_budget_bytes)
    for c0 in range(0, len(todo), per):
        group = todo[c0 : c0 + per]
        wg, wu, wd = (decode(t, ty, dtype) for t, ty in zip(  # [c, I, H], [c, I, H], [c, H, I]
            _select(experts, [j for _, j in group]), (experts.ggml_type,) * 2 + (experts.down_type,)))
        for i, (e, j) in enumerate(group):
            r0, r1 = starts[e], starts[e + 1]
            xe = x[r0:r1]
            g = (xe @ wg[i].T).float() + experts.gate_bias[j]
            u = (xe @ wu[i].T).float() + experts.up_bias[j]
            a = _swiglu(g, u, alpha, limit).to(dtype)
            y[r0:r1] = (a @ wd[i].T).float() + experts.down_bias[j]


def combine(out: torch.Tensor, y: torch.Tensor, grouping: Grouping, weights: torch.Tensor) -> torch.Tensor:
    """out[t] += sum of the token's expert rows times their routing weights."""
    w_rows = weights.reshape(-1).index_select(0, grouping.pairs).float()
    return out.index_add_(0, grouping.tok, y * w_rows[:, None])


def routed_experts(
    h: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    experts: RawExperts,
    alpha: float,
    limit: float,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    decode_budget_bytes: int = DEFAULT_DECODE_BUDGET_BYTES,
) -> torch.Tensor:
    """out[t] += sum over choices j with ids[t, j] >= 0 of weights[t, j] * expert_{ids[t, j]}(h[t]).

    h: [T, H] float32; ids: [T, k] int ids into `experts` (-1 = skip); weights: [T, k] float32;
    all on the experts' device. Returns `out` ([T, H] float32, zeros if None).
    """
    H, _ = experts.dims
    if out is None:
        out = torch.zeros((h.shape[0], H), dtype=torch.float32, device=h.device)
    grouping = group_rows(ids, experts.gate.shape[0])
    if grouping.pairs.numel() == 0:
        return out
    x = h.index_select(0, grouping.tok).to(dtype)  # [R, H] rows in expert order
    y = torch.empty((x.shape[0], H), dtype=torch.float32, device=h.device)
    expert_rows(x, y, grouping.starts, experts, [(e, e) for e in grouping.hit()], alpha, limit,
                dtype, decode_budget_bytes)
    return combine(out, y, grouping, weights)


class ResidentExperts:
    """A layer's experts uploaded once to `device` as raw blocks; decoded per hit expert."""

    kind = RESIDENT

    def __init__(self, experts: RawExperts, alpha: float, limit: float, dtype: torch.dtype,
                 decode_budget_bytes: int = DEFAULT_DECODE_BUDGET_BYTES):
        self.experts = experts
        self.alpha, self.limit = alpha, limit
        self.dtype = dtype
        self.decode_budget_bytes = decode_budget_bytes

    def __call__(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        dev = self.experts.gate.device
        out = routed_experts(
            h.to(dev).float(), ids.to(dev), weights.to(dev), self.experts, self.alpha, self.limit,
            self.dtype, decode_budget_bytes=self.decode_budget_bytes,
        )
        return out.to(h.device)
