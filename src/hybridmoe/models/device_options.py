"""How weights placed off the CPU are held and computed: one typed value per model."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridmoe.models.device_experts import DEFAULT_DECODE_BUDGET_BYTES
from hybridmoe.models.experts_streamed import StreamCost
from hybridmoe.placement.plan import Plan
from hybridmoe.settings import PlacementSettings


KV_DTYPES = {4: torch.float32, 2: torch.float16}  # plan bytes per cached value -> cache dtype


@dataclass(frozen=True)
class DeviceOptions:
    """How weights placed off the CPU are held and computed.

    upload_buffers: the streamed backend's two device upload buffers hold this many layers'
        experts together (the plan's count; 0 = never stream, CPU experts run staged).
    gpu_dense_dtype: dense weights on an accelerator, weights.DenseLinear's dtype ("stored",
        "bf16", "f16", "f32"; None = f32); CPU-placed dense weights ignore it.
    compute_dtype: dtype of device matmuls: expert weights and stored dense weights are decoded
        to it (float32, the default, keeps the CPU path's accuracy; bf16 is --fast-math's).
    kv_dtype: the KV cache's dtype when any layer's attention is on an accelerator (a CPU-only
        model keeps float32, what the C decode kernel reads).
    decode_budget_bytes: decoded expert weights alive at once on the device.
    cost: when a batch of a streamed layer goes to the device (StreamCost).
    """

    upload_buffers: int = PlacementSettings().upload_buffers
    gpu_dense_dtype: str | None = None
    compute_dtype: torch.dtype = torch.float32
    kv_dtype: torch.dtype = torch.float32
    decode_budget_bytes: int = DEFAULT_DECODE_BUDGET_BYTES
    cost: StreamCost = field(default_factory=StreamCost)

    def __post_init__(self) -> None:
        if self.upload_buffers < 0:
            raise ValueError(f"upload_buffers must be >= 0, got {self.upload_buffers}")

    def dense_dtype(self, device: torch.device) -> str | None:
        """DenseLinear dtype for a dense weight placed on `device` (None = its default)."""
        return None if torch.device(device).type == "cpu" else self.gpu_dense_dtype

    @classmethod
    def from_plan(cls, plan: Plan) -> "DeviceOptions":
        """The plan's upload buffers and resolved numerics (dense dtype, KV bytes, --fast-math)."""
        o = plan.options
        p = o.placement
        return cls(upload_buffers=p.upload_buffers,
                   gpu_dense_dtype=None if p.gpu_dense_dtype == "auto" else p.gpu_dense_dtype,
                   compute_dtype=torch.bfloat16 if o.fast_math else torch.float32,
                   kv_dtype=KV_DTYPES.get(o.kv_dtype_bytes, torch.float32))
