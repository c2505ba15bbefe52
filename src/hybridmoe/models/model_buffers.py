"""Staging and upload buffers owned by one model and freed with it.

Layers run one after another on one engine thread, so the layers of a model share one set of
buffers per shape (120b: one set instead of 36); each model has its own, so dropping a model
frees its pinned host memory and device buffers.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from hybridmoe.models.device_sync import DeviceSync

T = TypeVar("T")


class ModelBuffers:
    """Buffers shared by one model's layers, made on first use, keyed by what they hold."""

    def __init__(self) -> None:
        self._items: dict[tuple, object] = {}

    def shared(self, key: tuple, make: Callable[[], T]) -> T:
        """The buffer set for `key`, made by `make()` the first time it is asked for."""
        if key not in self._items:
            self._items[key] = make()
        return self._items[key]  # type: ignore[return-value]

    def sync(self, device: torch.device) -> DeviceSync:
        """The device's copy stream and events (one copy stream per device and model)."""
        return self.shared(("sync", torch.device(device)), lambda: DeviceSync(device))

    def __len__(self) -> int:
        return len(self._items)
