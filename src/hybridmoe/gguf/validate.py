"""Checks on the metadata values a model reads, before anything is allocated.

Every failure is a `GGUFError` whose message names the file, the key and the offending value, so
`serve` / `generate` can print it as one line.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hybridmoe.gguf.errors import GGUFError


class MetadataValues:
    """Typed, range-checked reads of `{prefix}{key}` from a metadata dict."""

    def __init__(self, meta: Mapping[str, Any], source: str, prefix: str = "") -> None:
        self.meta = meta
        self.source = source
        self.prefix = prefix

    def fail(self, key: str, value: Any, why: str) -> GGUFError:
        return GGUFError(f"{self.source}: metadata {self.prefix}{key} = {_short(value)}: {why}")

    def has(self, key: str) -> bool:
        return self.prefix + key in self.meta

    def raw(self, key: str, default: Any = None) -> Any:
        full = self.prefix + key
        if full in self.meta:
            return self.meta[full]
        if default is None:
            raise GGUFError(f"{self.source}: missing metadata key {full!r}")
        return default

    def int(self, key: str, default: int | None = None, minimum: int = 1,
            maximum: int | None = None) -> int:
        """An integer in [minimum, maximum]; a float is accepted only when it is integral."""
        v = self.raw(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.fail(key, v, "must be an integer")
        if isinstance(v, float):
            if not math.isfinite(v) or v != int(v):
                raise self.fail(key, v, "must be an integer")
            v = int(v)
        if v < minimum:
            raise self.fail(key, v, f"must be at least {minimum}")
        if maximum is not None and v > maximum:
            raise self.fail(key, v, f"must be at most {maximum}")
        return v

    def float(self, key: str, default: float | None = None, above: float | None = 0.0) -> float:
        """A finite number, strictly greater than `above` (None: any finite value)."""
        v = self.raw(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.fail(key, v, "must be a number")
        v = float(v)
        if not math.isfinite(v):
            raise self.fail(key, v, "must be a finite number")
        if above is not None and not v > above:
            raise self.fail(key, v, f"must be greater than {above:g}")
        return v


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
