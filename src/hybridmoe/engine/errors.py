"""The engine's refusals, each with the answer the server turns it into."""

from __future__ import annotations


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_queue`; the server answers 503."""


class EngineClosedError(RuntimeError):
    """The engine was shut down."""


class SlotError(ValueError):
    """A slot action names a slot that does not exist or is busy."""
