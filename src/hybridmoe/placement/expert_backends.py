"""Which expert backend runs each layer: one rule, read by the model at load and by `hybridmoe plan`.

Torch-free, so the plan command can print it without loading anything.
"""

from __future__ import annotations

from hybridmoe.placement.rules import CPU

# Experts in the mmap, activations on the CPU: the C kernels, nothing copied.
CPU_KERNELS = "cpu"
# Experts in the mmap, activations on an accelerator: hidden states and routing cross to the C
# kernels through pinned buffers and the result comes back (no upload buffers to stream with).
STAGED = "staged"
# As STAGED for small batches; batches big enough to pay for it upload the experts they hit
# into the model's upload buffers and compute them on the accelerator (the prompt path).
STREAMED = "stream"
# Experts uploaded to the accelerator at load and computed there.
RESIDENT = "gpu"

EXPERT_BACKENDS = (CPU_KERNELS, STAGED, STREAMED, RESIDENT)


def experts_device(part_devices: list[str]) -> str:
    """Where a layer's experts run when -ot split their tensors: the CPU if any part is there
    (the mmap serves them all), else the device of the first part."""
    return CPU if CPU in part_devices or not part_devices else part_devices[0]


def expert_backend(activations_device: str, experts_device: str, upload_buffers: int) -> str:
    """The backend for a layer whose router (hence the MoE's activations) sits on
    `activations_device` and whose expert weights sit on `experts_device`."""
    if experts_device != CPU:
        return RESIDENT
    if activations_device == CPU:
        return CPU_KERNELS
    return STREAMED if upload_buffers > 0 else STAGED
