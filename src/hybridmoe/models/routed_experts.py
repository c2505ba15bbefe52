"""One interface for a layer's routed experts, and the backend of each layer picked once at load.

Backends (the rule that picks one is placement.expert_backends, shared with `hybridmoe plan`):
  cpu     experts_cpu.CpuExperts         C kernels on the mmap, activations on the CPU
  staged  experts_cpu.StagedExperts      C kernels on the mmap, activations on an accelerator
  stream  experts_streamed.StreamedExperts  as staged, big batches streamed to the accelerator
  gpu     device_experts.ResidentExperts raw blocks uploaded at load, torch on the accelerator
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from hybridmoe import kernels
from hybridmoe.gguf.constants import GGMLType
from hybridmoe.gguf.reader import ModelFile
from hybridmoe.models.device_experts import RawExperts, ResidentExperts
from hybridmoe.models.device_options import DeviceOptions
from hybridmoe.models.experts_cpu import CpuExperts, StagedExperts
from hybridmoe.models.experts_streamed import ExpertStreamer, StreamedExperts
from hybridmoe.models.loader import WeightLoader
from hybridmoe.models.model_buffers import ModelBuffers
from hybridmoe.models.weights import load_f32, upload_rows
from hybridmoe.placement.expert_backends import (
    CPU_KERNELS,
    RESIDENT,
    STAGED,
    STREAMED,
    expert_backend,
    experts_device,
)


class RoutedExperts(Protocol):
    """Computes one layer's routed experts for hidden states already routed (top-k ids, weights)."""

    kind: str  # placement.expert_backends: "cpu" | "staged" | "stream" | "gpu"

    def __call__(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """h [T, H], ids [T, k] int, weights [T, k] -> [T, H] float32 on h's device."""
        ...


@dataclass
class LayerExperts:
    """One layer's routed experts as mmap views (kernels.ExpertTensors) and the down type."""

    tensors: kernels.ExpertTensors
    down_type: GGMLType


def load_layer_experts(mf: ModelFile, names: dict[str, str], fused: bool, ffn: int) -> LayerExperts:
    """gate / up / down views into the mmap (a fused gate_up tensor split in halves) + biases."""
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
    down_type = mf.tensors[names["down_exps"]].ggml_type
    tensors = kernels.ExpertTensors(gate=gate, up=up, down=mf.raw(names["down_exps"]), gate_bias=gate_b,
                                    up_bias=up_b, down_bias=load_f32(mf, names["down_exps_bias"]),
                                    ggml_type=wtype, down_type=down_type)
    return LayerExperts(tensors, down_type)


def upload_experts(experts: LayerExperts, device: torch.device) -> RawExperts:
    """The raw blocks and biases copied once to `device` (quantized: 4.25 bits/weight for MXFP4)."""
    ex = experts.tensors
    parts: list[np.ndarray] = [ex.gate, ex.up, ex.down]
    biases = [b if b is not None else torch.zeros(a.shape[:2]) for a, b in
              zip(parts, (ex.gate_bias, ex.up_bias, ex.down_bias))]
    return RawExperts(*(upload_rows(a, device) for a in parts), *(b.to(device) for b in biases),
                      ggml_type=ex.ggml_type, down_type=experts.down_type)


def make_routed_experts(kind: str, experts: LayerExperts, *, activations_device: torch.device,
                        experts_device: torch.device, alpha: float, limit: float, act: kernels.Activations,
                        buffers: ModelBuffers, options: DeviceOptions) -> RoutedExperts:
    """The backend `kind` for one layer (see placement.expert_backends.expert_backend)."""
    ex = experts.tensors
    if kind == CPU_KERNELS:
        return CpuExperts(ex, alpha, limit, act)
    if kind == RESIDENT:
        return ResidentExperts(upload_experts(experts, experts_device), alpha, limit,
                               options.compute_dtype, options.decode_budget_bytes)
    staged = StagedExperts(ex, alpha, limit, act, activations_device, buffers)
    if kind == STAGED:
        return staged
    if kind == STREAMED:
        streamer = ExpertStreamer(ex, alpha, limit, activations_device, buffers, options.upload_buffers,
                                  options.compute_dtype, options.decode_budget_bytes)
        return StreamedExperts(staged, streamer, options.cost)
    raise ValueError(f"unknown expert backend {kind!r}")


def load_routed_experts(load: WeightLoader, names: dict[str, str], fused: bool, ffn: int,
                        activations_device: torch.device, alpha: float, limit: float) -> RoutedExperts:
    """A layer's experts with the backend its placement implies (placement.expert_backends)."""
    parts = [names[p] for p in (("gate_up_exps",) if fused else ("gate_exps", "up_exps")) + ("down_exps",)]
    exp_dev = experts_device([load.placement.device_of(n) for n in parts])
    kind = expert_backend(str(activations_device), exp_dev, load.options.upload_buffers)
    return make_routed_experts(kind, load_layer_experts(load.file, names, fused, ffn),
                               activations_device=activations_device, experts_device=torch.device(exp_dev),
                               alpha=alpha, limit=limit, act=load.act, buffers=load.buffers,
                               options=load.options)
