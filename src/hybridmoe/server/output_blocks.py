"""ChatView deltas -> an ordered list of typed output blocks (reasoning, text, function call).

The Responses and Messages APIs answer with lists of parts (output items, content blocks) rather
than one message with side fields, so both fold the chat deltas the same way: a block opens when
the kind of text changes or a tool call starts, and the previous one closes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from hybridmoe.engine.engine import EngineEvent
from hybridmoe.server.chat_view import ChatView

BlockKind = Literal["reasoning", "text", "call"]


@dataclass
class Block:
    kind: BlockKind
    index: int  # position in the reply
    text: str = ""  # reasoning or answer text; a call's arguments (JSON text)
    name: str = ""  # call: the function's name
    call_id: str = ""  # call: the id the client's tool result refers to
    logprobs: list[Any] = field(default_factory=list)  # text: its tokens' TokenLogprobs, when asked for


@dataclass(frozen=True)
class BlockEvent:
    kind: Literal["open", "delta", "close"]
    block: Block
    text: str = ""  # delta only
    logprobs: tuple[Any, ...] = ()  # delta of a text block: the TokenLogprobs of the tokens it adds


class BlockFolder:
    """Feed the deltas of `ChatView.push`; get open/delta/close events; `blocks` is the reply so far."""

    def __init__(self, view: ChatView) -> None:
        self.view = view
        self.blocks: list[Block] = []
        self.final: EngineEvent | None = None  # the engine's last event, once the reply is over
        self.token_ids: list[int] = []  # the reply's tokens (a stop string may have cut inside markup)
        self._open: Block | None = None

    async def stream(self, events: AsyncIterator[EngineEvent]) -> AsyncIterator[BlockEvent]:
        """The block events of a whole reply; afterwards `final` holds the finishing engine event."""
        async for ev in events:
            if ev.token_id is not None:
                self.token_ids.append(ev.token_id)
            deltas = self.view.push(ev)
            answer_lp = ev.logprob if self.view.answer_token else None
            for bev in self.feed(deltas, answer_lp):
                yield bev
            if ev.finish_reason is not None:
                self.final = ev
                for bev in self.close():
                    yield bev

    def feed(self, deltas: list[dict[str, Any]], answer_lp: Any = None) -> list[BlockEvent]:
        """`answer_lp`: the logprobs of the event's token when it is answer text; they go with the
        text block (held-back text comes later, so the token may come before its text)."""
        out: list[BlockEvent] = []
        if answer_lp is not None and (self._open is None or self._open.kind != "text"):
            out += self._start("text")
        for d in deltas:
            for call in d.get("tool_calls") or ():
                fn = call.get("function") or {}
                if "id" in call:  # a call starts (its name comes with it)
                    out += self._start("call", name=fn.get("name") or "", call_id=call["id"])
                if fn.get("arguments"):
                    out += self._append(fn["arguments"])
            for key, kind in (("reasoning_content", "reasoning"), ("content", "text")):
                if d.get(key):
                    if self._open is None or self._open.kind != kind:
                        out += self._start(kind)
                    out += self._append(d[key])
        if answer_lp is not None:  # on this event's text delta, or alone when its text is held back
            block = self._open
            assert block is not None and block.kind == "text"
            block.logprobs.append(answer_lp)
            last = out[-1] if out else None
            if last is not None and last.kind == "delta" and last.block is block:
                out[-1] = BlockEvent("delta", block, last.text, (answer_lp,))
            else:
                out.append(BlockEvent("delta", block, "", (answer_lp,)))
        return out

    def close(self) -> list[BlockEvent]:
        """End of the reply: close the open block."""
        if self._open is None:
            return []
        block, self._open = self._open, None
        return [BlockEvent("close", block)]

    def _start(self, kind: BlockKind, name: str = "", call_id: str = "") -> list[BlockEvent]:
        out = self.close()
        self._open = Block(kind, len(self.blocks), name=name, call_id=call_id)
        self.blocks.append(self._open)
        return out + [BlockEvent("open", self._open)]

    def _append(self, text: str) -> list[BlockEvent]:
        assert self._open is not None
        self._open.text += text
        return [BlockEvent("delta", self._open, text)]
