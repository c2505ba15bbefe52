"""Weight holders shared by model files: dense linears, a fused q/k/v projection, loaders.

Dense weights: on the CPU, block types the C kernels read stay quantized in the mmap and run
through the C GEMV (exact float32 arithmetic); Q4_0, Q5_0 and IQ4_NL, whose values are Q8_0 values,
are transcoded once to Q8_0 (exact) and take its kernels, fast math included; F16/BF16 become
float32. On an accelerator, quantized weights are
converted once (float32 by default; bf16 with --fast-math) or kept as raw blocks ("stored") and
decoded per call in row chunks, which is what a small card needs (120b attention: 0.95 GiB Q8_0,
1.78 GiB bf16, 3.6 GiB f32); the plan picks (placement.plan). F32 tensors stay float32 everywhere.

Routed experts have their own backends (expert_backends).
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from hybridmoe import kernels
from hybridmoe.gguf.constants import GGMLType
from hybridmoe.gguf.reader import ModelFile
from hybridmoe.quant.formats import Q8_0_EXACT_TYPES, to_q8_0
from hybridmoe.quant.torch_dequant import dequantize_torch

DENSE_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
_FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
_CHUNK_BYTES = 64 << 20  # decoded bytes per row chunk (conversion and stored-mode matmuls)
_PROGRESS_MIN_BYTES = 256 << 20  # conversions this large (the output head) get a progress bar


def _to_torch(arr: np.ndarray) -> torch.Tensor:
    # Copy: the mmap is read-only and this tensor is small or about to be converted anyway.
    return torch.from_numpy(np.array(arr))


def load_f32(mf: ModelFile, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """Any stored type -> float32 tensor on `device` (values exact: every format decodes exactly)."""
    info = mf.tensors[name]
    if info.ggml_type == GGMLType.F32:
        t = _to_torch(mf.array(name)).float()
    elif info.ggml_type == GGMLType.F16:
        t = _to_torch(mf.array(name)).float()
    else:
        t = dequantize_torch(_to_torch(mf.raw(name)), info.ggml_type)
    return t.reshape(info.shape).to(device)


def _row_chunks(n_rows: int, row_elems: int, elem_bytes: int) -> list[tuple[int, int]]:
    step = max(1, _CHUNK_BYTES // max(1, row_elems * elem_bytes))
    return [(r, min(n_rows, r + step)) for r in range(0, n_rows, step)]


def convert_rows(raw: np.ndarray, t: GGMLType, dtype: torch.dtype, device: torch.device,
                 label: str = "") -> torch.Tensor:
    """uint8 [N, row_bytes] of type t -> dtype [N, K] on `device`, decoded there chunk by chunk
    (bounded transient memory: a 1 GiB output head never exists as float32)."""
    n, K = raw.shape[0], dequantize_torch(torch.from_numpy(np.array(raw[:1])), t).shape[-1]
    out = torch.empty((n, K), dtype=dtype, device=device)
    chunks = _row_chunks(n, K, 4)
    if n * K * out.element_size() >= _PROGRESS_MIN_BYTES:
        from tqdm import tqdm

        chunks = tqdm(chunks, desc=f"converting {label} to {dtype}", unit="chunk", leave=False, disable=None)
    for r0, r1 in chunks:
        part = torch.from_numpy(np.array(raw[r0:r1])).to(device)
        out[r0:r1] = dequantize_torch(part, t).to(dtype)
    return out


def upload_rows(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A (possibly strided, read-only mmap) array -> contiguous tensor on `device`, copied in
    first-axis chunks so no second full-size host copy exists."""
    out = torch.empty(a.shape, dtype=torch.from_numpy(a[:0].copy()).dtype, device=device)
    row = int(np.prod(a.shape[1:])) * a.itemsize
    step = max(1, _CHUNK_BYTES // max(1, row))
    for r in range(0, a.shape[0], step):
        out[r : r + step].copy_(torch.from_numpy(np.array(a[r : r + step])))
    return out


def _default_dense_dtype(device: torch.device, t: GGMLType) -> str:
    if device.type == "cpu":
        return "stored" if t in kernels.KERNEL_TYPES and kernels.available() else "f32"
    return "f32"


def stored_blocks(mf: ModelFile, name: str) -> tuple[np.ndarray, GGMLType]:
    """A dense matrix's raw rows and type as the model holds them: the mmap view, or for the types
    whose values are exactly Q8_0 values (Q4_0, Q5_0, IQ4_NL) a Q8_0 copy, so one set of Q8_0
    kernels (fast math and the accelerator's stored mode included) serves them."""
    info = mf.tensors[name]
    if info.ggml_type in Q8_0_EXACT_TYPES:
        return to_q8_0(mf.raw(name), info.ggml_type), GGMLType.Q8_0
    return mf.raw(name), info.ggml_type


class DenseLinear:
    """y = x @ W^T + b for a [out, in] GGUF matrix; float32 in and out whatever W's dtype.

    dtype: None (CPU: the blocks in place through the C GEMV, exact; accelerator: "f32"), "stored"
    (raw blocks, decoded per call in row chunks), or "bf16" / "f16" / "f32" converted once.
    kernel=False keeps "stored" blocks on the CPU off the C GEMV (the accelerator code path; tests).
    compute_dtype: what "stored" weights are decoded to per call (float32 exact; bf16 fast math).
    act: the activation mode of the C GEMV (the model's fast-math setting).
    Expected error of bf16: input rows and W rounded to 8 mantissa bits, float32 accumulation:
    ~0.3% relative per matmul. Through a model it grows, mostly where a token's top-k expert
    choice flips: on the tiny random model, logits 0.12 relative overall, 0.035 median per token
    (tests/test_device_paths.py); "f32" matches the C kernels to ~5e-7.
    """

    def __init__(self, mf: ModelFile, weight: str, bias: str | None, device: torch.device,
                 dtype: str | None = None, *, kernel: bool = True,
                 act: kernels.Activations = kernels.Activations.FP32, compute_dtype: torch.dtype = torch.float32):
        info = mf.tensors[weight]
        self.act = act
        device = torch.device(device)
        self.name = weight
        self.bias = load_f32(mf, bias, device) if bias else None
        raw, stored_type = (None, info.ggml_type) if info.ggml_type in _FLOAT_TYPES else stored_blocks(mf, weight)
        mode = dtype or _default_dense_dtype(device, stored_type)
        if mode != "stored" and mode not in DENSE_DTYPES:
            raise ValueError(f"dense dtype must be 'stored' or one of {', '.join(DENSE_DTYPES)}, "
                             f"got {mode!r}")
        self.mode = mode
        self.raw: np.ndarray | None = None  # CPU mmap view for the C kernel
        self.raw_dev: torch.Tensor | None = None  # raw blocks on the device ("stored")
        self.weight: torch.Tensor | None = None
        self.ggml_type = stored_type
        if info.ggml_type in _FLOAT_TYPES:
            # F32 stays exact; half types are already 2 bytes and need no decode.
            want = torch.float32 if info.ggml_type == GGMLType.F32 else DENSE_DTYPES.get(mode, torch.float32)
            self.weight = load_f32(mf, weight, device).to(want)
        elif (mode == "stored" and kernel and device.type == "cpu" and stored_type in kernels.KERNEL_TYPES
              and kernels.available()):
            self.raw = raw  # an mmap view stays in the page cache and is read in place by the kernel
        elif mode == "stored":
            self.raw_dev = upload_rows(raw, device)
            self.compute_dtype = compute_dtype
        else:
            self.weight = convert_rows(raw, stored_type, DENSE_DTYPES[mode], device, weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.raw is not None:
            return kernels.linear_quantized(x.contiguous(), self.raw, self.ggml_type, self.bias, act=self.act)
        if self.raw_dev is not None:
            y = self._stored_matmul(x)
        elif self.weight.dtype == torch.float32:
            return torch.nn.functional.linear(x.float(), self.weight, self.bias)
        else:
            y = torch.nn.functional.linear(x.to(self.weight.dtype), self.weight).float()
        return y + self.bias if self.bias is not None else y

    def can_stack(self, other: "DenseLinear") -> bool:
        """Whether `other`'s rows can join this matrix's (same device, mode, dtype or block type,
        input size; biases on both or neither). The C kernel's mmap'd weights are never stacked."""
        if self.raw is not None or other.raw is not None or (self.bias is None) != (other.bias is None):
            return False
        if self.weight is not None and other.weight is not None:
            w, o = self.weight, other.weight
            return w.device == o.device and w.dtype == o.dtype and w.shape[1:] == o.shape[1:]
        if self.raw_dev is not None and other.raw_dev is not None:
            w, o = self.raw_dev, other.raw_dev
            return (w.device == o.device and self.ggml_type == other.ggml_type and w.shape[1:] == o.shape[1:]
                    and self.compute_dtype == other.compute_dtype)
        return False

    def stacked(self, others: list["DenseLinear"]) -> "DenseLinear":
        """A DenseLinear computing this one's outputs then each of `others`' (see can_stack)."""
        out = copy.copy(self)
        parts = [self, *others]
        out.name = "+".join(p.name for p in parts)
        if self.weight is not None:
            out.weight = torch.cat([p.weight for p in parts])
        else:
            out.raw_dev = torch.cat([p.raw_dev for p in parts])
        if self.bias is not None:
            out.bias = torch.cat([p.bias for p in parts])
        return out

    def _stored_matmul(self, x: torch.Tensor) -> torch.Tensor:
        n = self.raw_dev.shape[0]
        xc = x.to(self.compute_dtype)
        y = torch.empty((x.shape[0], n), dtype=torch.float32, device=x.device)
        for r0, r1 in _row_chunks(n, xc.shape[-1], 4):
            w = dequantize_torch(self.raw_dev[r0:r1], self.ggml_type).to(self.compute_dtype)
            y[:, r0:r1] = (xc @ w.T).float()
        return y


class FusedQKV:
    """q, k and v read by the C kernel from the mmap in one call (decode steps are short enough
    that a call's fixed cost shows)."""

    def __init__(self, q: DenseLinear, k: DenseLinear, v: DenseLinear, act: kernels.Activations):
        self.group = kernels.LinearGroup([p.raw for p in (q, k, v)], [p.bias for p in (q, k, v)], q.ggml_type,
                                         act=act)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[N, q + k + v outputs]."""
        return self.group(x)


class SeparateQKV:
    """q, k and v as three DenseLinears (mixed types or modes), outputs side by side."""

    def __init__(self, q: DenseLinear, k: DenseLinear, v: DenseLinear):
        self.q, self.k, self.v = q, k, v

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.q(x), self.k(x), self.v(x)), dim=1)


def qkv_projection(q: DenseLinear, k: DenseLinear, v: DenseLinear,
                   act: kernels.Activations) -> FusedQKV | DenseLinear | SeparateQKV:
    """One kernel call when all three are mmap'd for the C kernel in the same type; one stacked
    matrix when all three are held alike on a device (one matmul launch); else three."""
    if all(p.raw is not None and p.ggml_type == q.ggml_type for p in (q, k, v)):
        return FusedQKV(q, k, v, act)
    if all(p.can_stack(q) for p in (k, v)):
        return q.stacked([k, v])
    return SeparateQKV(q, k, v)
