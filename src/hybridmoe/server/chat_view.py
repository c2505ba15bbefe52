"""Engine events -> OpenAI chat message deltas, per `--reasoning-format`.

`none`: the raw generated text (harmony markup included) is the content.
`auto`/`deepseek`: generated tokens go through the harmony parser; the analysis channel becomes
`reasoning_content`, final/commentary-without-recipient becomes `content`, and messages addressed
to `functions.NAME` become `tool_calls` (name first, then argument fragments). Output with no
harmony structure (an untrained model) is plain content.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from hybridmoe.engine.engine import EngineEvent, find_stop, safe_prefix_len
from hybridmoe.tokenizer.harmony import Event, HarmonyParser


class ChatView:
    """Accumulates one response; `push` returns the deltas to stream for one engine event."""

    def __init__(self, tokenizer: Any, raw: bool, stop: Sequence[str] = (), prefix_ids: Sequence[int] = (),
                 context_ids: Sequence[int] = ()) -> None:
        """prefix_ids: tokens the server put after the prompt's generation header on the model's
        behalf (a forced tool-call header); they are part of the response, as if generated.
        context_ids: the continued message's tokens (continue_final_message): they set the
        parser's state (channel) but are not sent again."""
        self.raw = raw
        self._tokenizer = tokenizer
        self._parser = None if raw else HarmonyParser(tokenizer)
        # The engine cuts stop strings from its raw text; parsed channels need the same cut.
        self._stop = list(stop)
        self._held = {"content": "", "reasoning_content": ""}
        self._stopped = False
        self.stop_sequence: str | None = None  # the stop string that cut the parsed text, if one did
        self.reasoning_tokens = 0  # generated tokens inside analysis messages (content + end token)
        self.answer_token = False  # the last pushed token is text of a final-channel message (Responses logprobs)
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._tools: list[dict[str, Any]] = []
        self._pending: list[dict[str, Any]] = []  # the prefix's deltas, sent with the first push
        for tid in context_ids if not raw else ():
            self._parser.push(tid)
        if prefix_ids and raw:
            text = tokenizer.decode(list(prefix_ids))
            self._content.append(text)
            self._pending.append({"content": text})
        elif prefix_ids:
            for tid in prefix_ids:
                for hev in self._parser.push(tid):
                    self._pending += self._on_harmony(hev)

    def push(self, ev: EngineEvent) -> list[dict[str, Any]]:
        deltas, self._pending = self._pending, []
        if self.raw:
            self.answer_token = ev.token_id is not None
            if ev.text:
                self._content.append(ev.text)
                deltas.append({"content": ev.text})
            return deltas
        ids = [t for t in (ev.token_id, ev.stop_token_id) if t is not None]
        self.answer_token = False
        for tid in ids:
            header = self._parser.open_header
            if header is not None and header.target == "reasoning":
                self.reasoning_tokens += 1
            if tid == ev.token_id:
                self.answer_token = (header is not None and header.target == "content"
                                     and not self._tokenizer.is_special(tid))
            for hev in self._parser.push(tid):
                deltas += self._on_harmony(hev)
        if ev.finish_reason is not None:
            for hev in self._parser.finish():
                deltas += self._on_harmony(hev)
            for key, held in self._held.items():
                if held and not self._stopped:
                    deltas.append(self._append(key, held))
        return deltas

    def _on_harmony(self, hev: Event) -> list[dict[str, Any]]:
        target = hev.target
        if target == "tool_call":
            if hev.kind == "start":
                call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                        "function": {"name": hev.header.tool_name, "arguments": ""}}
                self._tools.append(call)
                # A copy: the call's arguments grow in place, and this delta may be sent later.
                return [{"tool_calls": [{"index": len(self._tools) - 1, **call,
                                         "function": dict(call["function"])}]}]
            if hev.kind == "delta" and hev.text:
                self._tools[-1]["function"]["arguments"] += hev.text
                return [{"tool_calls": [{"index": len(self._tools) - 1, "function": {"arguments": hev.text}}]}]
            return []
        if hev.kind != "delta" or not hev.text or self._stopped:
            return []
        key = "reasoning_content" if target == "reasoning" else "content"
        held = self._held[key] + hev.text
        hit = find_stop(held, self._stop)
        if hit is not None:
            self._stopped = True
            self.stop_sequence = next(s for s in self._stop if s and held.startswith(s, hit))
            self._held[key] = ""
            return [self._append(key, held[:hit])] if hit else []
        n = safe_prefix_len(held, self._stop)
        self._held[key] = held[n:]
        return [self._append(key, held[:n])] if n else []

    def _append(self, key: str, text: str) -> dict[str, Any]:
        (self._reasoning if key == "reasoning_content" else self._content).append(text)
        return {key: text}

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
