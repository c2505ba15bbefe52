"""Routed experts computed by the C kernels on the GGUF mmap (zero copy).

`CpuExperts`: the activations are on the CPU too; one kernel call per layer.
`StagedExperts`: the activations live on an accelerator; only the hidden states and the routing
(ids, weights) cross to the kernels and the result comes back, through pinned buffers the
model owns and reuses across layers and steps.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridmoe import kernels
from hybridmoe.models.device_sync import DeviceSync
from hybridmoe.models.model_buffers import ModelBuffers
from hybridmoe.placement.expert_backends import CPU_KERNELS, STAGED


class CpuExperts:
    """Activations and experts both on the CPU: the fused kernel, in this model's activation mode."""

    kind = CPU_KERNELS

    def __init__(self, experts: kernels.ExpertTensors, alpha: float, limit: float, act: kernels.Activations):
        self.experts = experts
        self.alpha, self.limit = alpha, limit
        self.act = act

    def __call__(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """h [T, H], ids [T, k] int, weights [T, k] (CPU) -> [T, H] float32."""
        return kernels.moe_forward(h.float().contiguous(), ids.contiguous(), weights.float().contiguous(),
                                   self.experts, swiglu_alpha=self.alpha, swiglu_limit=self.limit, act=self.act)


class RouteBuffers:
    """Host x / ids / weights / out buffers (pinned for CUDA), grown to the largest batch."""

    def __init__(self, hidden: int, k: int, sync: DeviceSync):
        self.hidden, self.k = hidden, k
        self.sync = sync
        self.capacity = 0
        self.out_free: Any = None  # event: the last upload out of `out` finished

    def grow(self, T: int) -> None:
        if T <= self.capacity:
            return
        self.sync.host_wait(self.out_free)  # no copy may still read the buffer being replaced
        cap = 1 << max(0, T - 1).bit_length()
        self.x = self.sync.pinned((cap, self.hidden), torch.float32)
        self.ids = self.sync.pinned((cap, self.k), torch.int32)
        self.wts = self.sync.pinned((cap, self.k), torch.float32)
        self.out = self.sync.pinned((cap, self.hidden), torch.float32)
        self.capacity, self.out_free = cap, None


class StagedExperts:
    """Experts in the mmap, activations on `device`: copy in, C kernels, copy the result back."""

    kind = STAGED

    def __init__(self, experts: kernels.ExpertTensors, alpha: float, limit: float, act: kernels.Activations,
                 device: torch.device, buffers: ModelBuffers):
        self.cpu = CpuExperts(experts, alpha, limit, act)
        self.hidden = experts.dims()[0]
        self.device = torch.device(device)
        self.buffers = buffers
        self.sync = buffers.sync(self.device)

    def __call__(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """h [T, H], weights [T, k] on `device`; ids [T, k] int anywhere -> [T, H] float32 on `device`."""
        T, k = ids.shape
        sync, H = self.sync, self.hidden
        buf = self.buffers.shared(("route", self.device, H, k), lambda: RouteBuffers(H, k, sync))
        buf.grow(T)
        x, i, w = buf.x[:T], buf.ids[:T], buf.wts[:T]
        x.copy_(h, non_blocking=True)
        i.copy_(ids, non_blocking=True)
        w.copy_(weights, non_blocking=True)
        sync.host_wait_current()  # the device-to-host copies landed before the CPU reads them
        y = self.cpu(x, i, w)
        sync.host_wait(buf.out_free)  # the previous layer's upload out of `out` is done
        buf.out[:T].copy_(y)
        res = torch.empty((T, H), dtype=torch.float32, device=self.device)
        res.copy_(buf.out[:T], non_blocking=True)
        buf.out_free = sync.record()
        return res
