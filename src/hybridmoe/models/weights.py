"""Weight holders shared by model files: dense linears and a layer's routed experts.

Dense tensors are converted once to float32 on their device, except Q8_0 tensors on the CPU
when the C kernels are built: those stay quantized in the mmap and use the streaming GEMV.
Expert tensors always stay in the mmap on the CPU (zero copy); on an accelerator they are
uploaded as raw blocks and decoded per expert when hit.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridmoe import kernels
from hybridmoe.gguf.constants import GGMLType
from hybridmoe.gguf.reader import ModelFile
from hybridmoe.quant.torch_dequant import dequantize_torch


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


class DenseLinear:
    """y = x @ W^T + b for a [out, in] GGUF matrix."""

    def __init__(self, mf: ModelFile, weight: str, bias: str | None, device: torch.device):
        info = mf.tensors[weight]
        self.name = weight
        self.out_features, self.in_features = info.shape[0], info.shape[-1] if len(info.shape) == 2 else None
        self.bias = load_f32(mf, bias, device) if bias else None
        self.raw: np.ndarray | None = None
        self.weight: torch.Tensor | None = None
        if device.type == "cpu" and info.ggml_type == GGMLType.Q8_0 and kernels.available():
            self.raw = mf.raw(weight)  # stays in the page cache; read in place by the kernel
        else:
            self.weight = load_f32(mf, weight, device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.raw is not None:
            return kernels.linear_q8_0(x.contiguous(), self.raw, self.bias)
        return torch.nn.functional.linear(x, self.weight, self.bias)


class ExpertLayer:
    """One layer's routed experts (gate, up, down + biases) with gpt-oss's clamped SwiGLU."""

    def __init__(
        self,
        mf: ModelFile,
        names: dict[str, str],
        fused: bool,
        device: torch.device,
        ffn: int,
        alpha: float,
        limit: float,
    ):
        self.device = device
        self.alpha, self.limit = alpha, limit
        if fused:
            gu = mf.raw(names["gate_up_exps"])
            gate, up = gu[:, :ffn], gu[:, ffn:]
            gub = load_f32(mf, names["gate_up_exps_bias"])
            gate_b, up_b = gub[:, :ffn].contiguous(), gub[:, ffn:].contiguous()
            wtype = mf.tensors[names["gate_up_exps"]].ggml_type
        else:
            gate, up = mf.raw(names["gate_exps"]), mf.raw(names["up_exps"])
            gate_b, up_b = load_f32(mf, names["gate_exps_bias"]), load_f32(mf, names["up_exps_bias"])
            wtype = mf.tensors[names["gate_exps"]].ggml_type
        down = mf.raw(names["down_exps"])
        down_b = load_f32(mf, names["down_exps_bias"])
        self.n_experts = down.shape[0]
        self.ggml_type = wtype
        self.down_type = mf.tensors[names["down_exps"]].ggml_type
        if device.type == "cpu":
            self.cpu = kernels.ExpertTensors(
                gate=gate, up=up, down=down, gate_bias=gate_b, up_bias=up_b, down_bias=down_b,
                ggml_type=wtype,
            )
        else:
            # Raw blocks on the accelerator (4.25 bits/weight), decoded per hit expert.
            self.cpu = None
            self.dev_w = [torch.from_numpy(np.ascontiguousarray(w)).to(device) for w in (gate, up, down)]
            self.dev_b = [b.to(device) for b in (gate_b, up_b, down_b)]

    def __call__(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.cpu is not None:
            # Only the hidden states and the routing cross to the CPU kernels and back.
            out = kernels.moe_forward(
                h.float().cpu().contiguous(), ids.cpu().contiguous(), weights.float().cpu().contiguous(),
                self.cpu, swiglu_alpha=self.alpha, swiglu_limit=self.limit,
            )
            return out.to(h.device)
        return self._device_forward(h, ids, weights)

    def _device_forward(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h, dtype=torch.float32)
        gw, uw, dw = self.dev_w
        gb, ub, db = self.dev_b
        for e in torch.unique(ids).tolist():
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            x = h[tok].float()
            g = x @ dequantize_torch(gw[e], self.ggml_type).T + gb[e]
            u = x @ dequantize_torch(uw[e], self.ggml_type).T + ub[e]
            g = g.clamp(max=self.limit)
            u = u.clamp(-self.limit, self.limit)
            a = g * torch.sigmoid(self.alpha * g) * (u + 1)
            y = a @ dequantize_torch(dw[e], self.down_type).T + db[e]
            out.index_add_(0, tok, y * weights[tok, slot, None])
        return out
