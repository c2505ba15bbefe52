"""Copy-stream and event helpers for one device; every call is a no-op on a non-CUDA device.

Lets the staging and streaming code read the same on CUDA and on the CPU (where the tests run
it), with no device branches of its own.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class DeviceSync:
    """A device's copy stream and events (CUDA), or synchronous no-ops (any other device)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None

    def pinned(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer for copies to and from this device (page-locked on CUDA: async DMA)."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.cuda)

    def record(self, stream: Any = None) -> Any:
        """An event marking the work queued so far on `stream` (default: the current stream)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return ev

    def on_copy_stream(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.copy_stream) if self.cuda else contextlib.nullcontext()

    def stream_wait(self, ev: Any, stream: Any = None) -> None:
        """Later work on `stream` (default: current) starts after `ev`; the host does not block."""
        if ev is not None:
            (stream if stream is not None else torch.cuda.current_stream(self.device)).wait_event(ev)

    @staticmethod
    def host_wait(ev: Any) -> None:
        if ev is not None:
            ev.synchronize()

    def host_wait_current(self) -> None:
        """Block the host until the work queued so far on the current stream is done."""
        self.host_wait(self.record())
