"""Engine events -> OpenAI chat message deltas, per `--reasoning-format`.

`none`: the raw generated text (harmony markup included) is the content.
`auto`/`deepseek`: generated tokens go through the harmony parser; the analysis channel becomes
`reasoning_content`, final/commentary-without-recipient becomes `content`, and messages addressed
to `functions.NAME` become `tool_calls` (name first, then argument fragments).
"""

from __future__ import annotations

import uuid
from typing import Any

from hybridmoe.engine.engine import EngineEvent
from hybridmoe.tokenizer.harmony import HarmonyParser

TOOL_PREFIX = "functions."


class ChatView:
    """Accumulates one response; `push` returns the deltas to stream for one engine event."""

    def __init__(self, tokenizer: Any, raw: bool) -> None:
        self.raw = raw
        self._parser = None if raw else HarmonyParser(tokenizer)
        self._raw_text: list[str] = []
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._tools: list[dict[str, Any]] = []
        self._tool_msg: object = None  # identity of the message the last tool call came from
        self._parsed_any = False

    def push(self, ev: EngineEvent) -> list[dict[str, Any]]:
        if ev.text:
            self._raw_text.append(ev.text)
        if self.raw:
            if ev.text:
                self._content.append(ev.text)
                return [{"content": ev.text}]
            return []
        deltas: list[dict[str, Any]] = []
        ids = [t for t in (ev.token_id, ev.stop_token_id) if t is not None]
        for tid in ids:
            for hev in self._parser.push(tid):
                deltas += self._on_harmony(hev)
        if ev.finish_reason is not None:
            for hev in self._parser.finish():
                deltas += self._on_harmony(hev)
            if not self._parsed_any and self._raw_text:
                # Output that never formed a harmony message (e.g. an untrained model): keep it as content.
                text = "".join(self._raw_text)
                self._content.append(text)
                deltas.append({"content": text})
        return deltas

    def _on_harmony(self, hev: Any) -> list[dict[str, Any]]:
        self._parsed_any = True
        recipient = hev.recipient or ""
        if recipient.startswith(TOOL_PREFIX):
            out = []
            if self._tool_msg is not hev.message_index:
                self._tool_msg = hev.message_index
                call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                        "function": {"name": recipient[len(TOOL_PREFIX):], "arguments": ""}}
                self._tools.append(call)
                out.append({"tool_calls": [{"index": len(self._tools) - 1, **call}]})
            if hev.text:
                self._tools[-1]["function"]["arguments"] += hev.text
                out.append({"tool_calls": [{"index": len(self._tools) - 1, "function": {"arguments": hev.text}}]})
            return out
        if not hev.text:
            return []
        if hev.channel == "analysis":
            self._reasoning.append(hev.text)
            return [{"reasoning_content": hev.text}]
        self._content.append(hev.text)
        return [{"content": hev.text}]

    def message(self) -> dict[str, Any]:
        """The complete assistant message (non-streaming response)."""
        msg: dict[str, Any] = {"content": "".join(self._content) if self._content or not self._tools else None}
        if self._reasoning:
            msg["reasoning_content"] = "".join(self._reasoning)
        if self._tools:
            msg["tool_calls"] = self._tools
        return msg

    def finish_reason(self, engine_reason: str) -> str:
        return "tool_calls" if self._tools and engine_reason == "stop" else engine_reason
