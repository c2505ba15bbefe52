"""Reads one model's weights onto their placed devices, with that model's settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from hybridmoe import kernels
from hybridmoe.gguf.reader import ModelFile
from hybridmoe.models.device_options import DeviceOptions
from hybridmoe.models.model_buffers import ModelBuffers
from hybridmoe.models.weights import DenseLinear, load_f32


class Placement(Protocol):
    def device_of(self, name: str) -> str: ...


class AllOn:
    """Every tensor on one device (the default: the CPU)."""

    def __init__(self, device: str):
        self.device = device

    def device_of(self, name: str) -> str:
        return self.device


@dataclass
class WeightLoader:
    """The file, where each tensor goes, and the per-model settings every weight is built with.

    act: the kernels' activation mode for this model (fast math: INT8), carried by each weight
    and expert backend, so two models in one process can compute differently.
    """

    file: ModelFile
    placement: Placement
    options: DeviceOptions
    act: kernels.Activations
    buffers: ModelBuffers = field(default_factory=ModelBuffers)

    def device(self, name: str) -> torch.device:
        return torch.device(self.placement.device_of(name))

    def f32(self, name: str) -> torch.Tensor:
        """Any stored type -> float32 on the tensor's placed device."""
        return load_f32(self.file, name, self.device(name))

    def dense(self, weight: str, bias: str | None) -> DenseLinear:
        """A dense matrix (and bias) on the weight's placed device, in the dtype the options give."""
        dev = self.device(weight)
        compute = torch.float32 if dev.type == "cpu" else self.options.compute_dtype
        return DenseLinear(self.file, weight, bias, dev, self.options.dense_dtype(dev), act=self.act,
                           compute_dtype=compute)
