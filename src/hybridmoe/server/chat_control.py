"""llama-server's POST /v1/chat/completions/control: act on a chat completion while it runs.

The one action is `reasoning_end` (the request must have armed it with `reasoning_control: true`):
the thinking it is in is closed now, as if its reasoning budget were spent, and the model goes on
to its answer. A client shows this as a "stop thinking" button.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from hybridmoe.engine.engine import RequestHandle
from hybridmoe.server.protocol import bad_request


@dataclass
class _Entry:
    handles: list[weakref.ref[RequestHandle]]
    armed: bool  # the request asked for reasoning_control

    def live(self) -> list[RequestHandle]:
        return [h for r in self.handles if (h := r()) is not None and not h.finished]


class LiveChats:
    """Running chat completions by id; handles held weakly, ended ones dropped as new ones come."""

    def __init__(self) -> None:
        self._by_id: dict[str, _Entry] = {}

    def add(self, cmpl_id: str, handles: list[RequestHandle], armed: bool) -> None:
        self._by_id = {k: e for k, e in self._by_id.items() if e.live()}
        self._by_id[cmpl_id] = _Entry([weakref.ref(h) for h in handles], armed)

    def control(self, cmpl_id: str, action: str) -> dict[str, Any]:
        """llama-server's answer: {"success": bool, "message": why not} (400 for a bad request)."""
        if not cmpl_id:
            raise bad_request("missing completion id", param="id")
        if action != "reasoning_end":
            raise bad_request("unknown control action", param="action")
        entry = self._by_id.get(cmpl_id)
        live = entry.live() if entry is not None else []
        if not live:
            return {"success": False, "message": "no active completion for this id"}
        if not entry.armed:
            return {"success": False, "message": "reasoning control not enabled for this completion"}
        for h in live:
            h.end_reasoning()
        return {"success": True}
