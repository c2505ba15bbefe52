"""The settings' error type and the argparse value parsers the flag groups share."""

from __future__ import annotations

import argparse
import json
from typing import Any


class SettingsError(ValueError):
    """A setting out of range; the message names the command-line flag, so the CLI and library
    users read the same words."""


def require(ok: bool, flag: str, rule: str, value: object) -> None:
    """Raise SettingsError("FLAG must RULE, got VALUE") unless `ok`."""
    if not ok:
        raise SettingsError(f"{flag} must {rule}, got {value!r}")


def on_off(value: str) -> str:
    """llama-server's switch values: on | off | auto (1/true and 0/false accepted)."""
    v = value.lower()
    if v not in ("on", "off", "auto", "1", "0", "true", "false"):
        raise argparse.ArgumentTypeError(f"expected on, off or auto, got {value!r}")
    return {"1": "on", "true": "on", "0": "off", "false": "off"}.get(v, v)


def byte_size(text: str) -> int:
    """A byte count with an optional k/M/G suffix (powers of 1024): '8M' -> 8388608."""
    t = text.strip()
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(t[-1:].lower(), 1)
    number = t[:-1] if scale > 1 else t
    try:
        value = int(float(number) * scale)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"expected a size in bytes such as 8388608 or 8M, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def json_object(text: str) -> dict[str, Any]:
    """A JSON object given on the command line (--chat-template-kwargs, --ui-config)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return obj
