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
        self.fuses_block = kernels.MoeBlock.supports(experts)  # `block` can run
        self._block: kernels.MoeBlock | None = None

    def __call__(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """h [T, H], ids [T, k] int, weights [T, k] (CPU) -> [T, H] float32."""
        return kernels.moe_forward(h.float().contiguous(), ids.contiguous(), weights.float().contiguous(),
                                   self.experts, swiglu_alpha=self.alpha, swiglu_limit=self.limit, act=self.act)

    def block(self, x: torch.Tensor, norm_w: torch.Tensor, eps: float, router_w: torch.Tensor,
              router_b: torch.Tensor | None, k: int,
              routing_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The whole MoE block, x + experts(rms_norm(x)) routed top-k, in one kernel call; the
        block's weights are bound on the first call (they are the layer's own, every call)."""
        if self._block is None:
            self._block = kernels.MoeBlock(norm_w, eps, router_w, router_b, k, self.experts, self.alpha,
                                           self.limit, self.act)
        return self._block(x, routing_out)


class RouteBuffers:
    """Host buffers (pinned for CUDA), grown to the largest batch: `packed` rows hold x, the routing
    weights and the int64 expert ids bit for bit (one copy from the device), `out` the result."""

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
        self.packed = self.sync.pinned((cap, self.hidden + 3 * self.k), torch.float32)
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

    def _buffers(self, T: int, k: int) -> RouteBuffers:
        H, sync = self.hidden, self.sync
        buf = self.buffers.shared(("route", self.device, H, k), lambda: RouteBuffers(H, k, sync))
        buf.grow(T)
        return buf

    def fetch(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [T, H], weights [T, k] float and ids [T, k] int on `device` -> the same on the host
        (x, int64 ids, weights), through one packed copy and one wait (each a launch or a sync
        on an accelerator)."""
        T, k = ids.shape
        H = self.hidden
        buf = self._buffers(T, k)
        packed = torch.cat((h.float(), weights.float(), ids.to(torch.int64).contiguous().view(torch.float32)), dim=1)
        host = buf.packed[:T]
        host.copy_(packed, non_blocking=True)
        self.sync.host_wait_current()  # the device-to-host copy landed before the CPU reads it
        return host[:, :H], host[:, H + k :].contiguous().view(torch.int64), host[:, H : H + k]

    def __call__(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """h [T, H], weights [T, k] and ids [T, k] int on `device` -> [T, H] float32 on `device`."""
        return self.compute(*self.fetch(h, ids, weights))

    def compute(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids, weights [T, k] on the host (fetch's) -> [T, H] float32 on `device`."""
        T, k = ids.shape
        H, sync = self.hidden, self.sync
        buf = self._buffers(T, k)
        y = self.cpu(x, ids, weights)
        sync.host_wait(buf.out_free)  # the previous layer's upload out of `out` is done
        buf.out[:T].copy_(y)
        res = torch.empty((T, H), dtype=torch.float32, device=self.device)
        res.copy_(buf.out[:T], non_blocking=True)
        buf.out_free = sync.record()
        return res
