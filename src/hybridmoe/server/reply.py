"""One typed reply: engine events in, reply events out, and the finished `Reply`.

Every API renders the same events: `TokenOut` (each token, its logprobs and live timings),
`BlockOpen` / `BlockDelta` / `BlockClose` for the reply's reasoning, text and tool-call blocks,
and `Finished` carrying the `Reply` (blocks, finish reason, stop word, usage, timings). With a
parser (the chat format's) the blocks follow the parsed reply; without one (raw output: legacy
and native completions, reasoning format `none`) the reply is one text block of the raw text.

Whatever the parser cannot make sense of stays text (or a call's raw arguments); what it had to
guess about is listed in `Reply.anomalies`, which the consumer logs once per request.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from hybridmoe.engine.engine import EngineEvent, Usage, find_stop, safe_prefix_len
from hybridmoe.engine.sampler import TokenLogprobs
from hybridmoe.tokenizer.chat_format import OutputEvent, OutputParser

BlockKind = Literal["reasoning", "text", "call"]


@dataclass
class Block:
    kind: BlockKind
    index: int  # position in the reply
    text: str = ""  # reasoning or answer text; a call's arguments (JSON text, as the model wrote it)
    name: str = ""  # call: the function's name
    call_id: str = ""  # call: the id the client's tool result refers to
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # text: its answer tokens' logprobs


@dataclass
class Reply:
    """A finished reply. `finish_reason` is the engine's (stop | length | cancelled | error)."""

    blocks: list[Block] = field(default_factory=list)
    finish_reason: str = "stop"
    stop_word: str | None = None  # the stop string that ended it
    stop_token_id: int | None = None  # the end-of-generation token that ended it
    usage: Usage | None = None
    timings: dict[str, float] | None = None
    error: str | None = None
    tokens: list[int] = field(default_factory=list)  # generated ids, the end token included
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # every generated token's, when asked for
    text: str = ""  # the raw text as the engine wrote it (markup included, stop string cut)
    reasoning_tokens: int = 0  # tokens spent thinking
    anomalies: list[str] = field(default_factory=list)  # malformed output, passed on as text
    slot_id: int = -1  # the slot that ran it (set by the consumer)

    def calls(self) -> list[Block]:
        return [b for b in self.blocks if b.kind == "call"]

    def joined(self, kind: BlockKind) -> str:
        return "".join(b.text for b in self.blocks if b.kind == kind)


@dataclass(frozen=True)
class TokenOut:
    """One engine event's token: `token_id` (None for an end-of-generation token, `stop_token_id`
    then), the raw text it added, its logprobs, and the timings so far when asked per token."""

    token_id: int | None
    stop_token_id: int | None
    text: str
    logprob: TokenLogprobs | None
    timings: dict[str, float] | None


@dataclass(frozen=True)
class BlockOpen:
    block: Block


@dataclass(frozen=True)
class BlockDelta:
    block: Block
    text: str
    logprobs: tuple[TokenLogprobs, ...] = ()  # text blocks: the answer tokens whose logprobs come with it


@dataclass(frozen=True)
class BlockClose:
    block: Block


@dataclass(frozen=True)
class Finished:
    reply: Reply


ReplyEvent = TokenOut | BlockOpen | BlockDelta | BlockClose | Finished


class ReplyBuilder:
    """Feed one request's engine events (`push`); get its reply events; `reply` is the result.

    parser: the chat format's parser (None: raw text). stop: the request's stop strings, cut from
    the parsed text as the engine cut them from the raw text. prefix_ids: tokens written after
    the prompt on the model's behalf (a forced call header): part of the reply. context_ids: a
    continued message's tokens: they set the parser's state but are not sent again.
    prefix_text: raw mode's version of the prefix. is_special: which ids are special tokens."""

    def __init__(self, parser: OutputParser | None, *, stop: Sequence[str] = (), prefix_ids: Sequence[int] = (),
                 context_ids: Sequence[int] = (), prefix_text: str = "",
                 is_special: Callable[[int], bool] = lambda _: False) -> None:
        self._parser = parser
        self._stop = [s for s in stop if s]
        self._is_special = is_special
        self.reply = Reply()
        self._open: Block | None = None
        self._held = {"text": "", "reasoning": ""}  # parsed text that could still start a stop string
        self._stopped = False
        self._pending: list[ReplyEvent] = []  # the prefix's events, sent with the first push
        if parser is None:
            self._pending += self._append("text", prefix_text) if prefix_text else []
            return
        for tid in context_ids:
            parser.push(tid)
        for tid in prefix_ids:
            self._pending += self._parsed(parser.push(tid))

    def push(self, ev: EngineEvent) -> list[ReplyEvent]:
        out, self._pending = self._pending, []
        r = self.reply
        r.text += ev.text
        ids = [t for t in (ev.token_id, ev.stop_token_id) if t is not None]
        r.tokens += ids
        if ev.logprob is not None:
            r.logprobs.append(ev.logprob)
        answer = self._feed(ids, ev, out)
        if ids or ev.text or ev.logprob is not None:
            out.insert(0, TokenOut(ev.token_id, ev.stop_token_id, ev.text, ev.logprob, ev.timings))
        if answer and ev.logprob is not None:
            self._attach_answer_logprob(ev.logprob, out)
        if ev.finish_reason is not None:
            out += self._finish(ev)
        return out

    def _feed(self, ids: list[int], ev: EngineEvent, out: list[ReplyEvent]) -> bool:
        """Parse the event's tokens into `out`; whether its token is answer text."""
        if self._parser is None:
            out += self._append("text", ev.text) if ev.text else []
            return ev.token_id is not None
        answer = False
        for tid in ids:
            target = self._parser.open_target
            if target == "reasoning":
                self.reply.reasoning_tokens += 1
            if tid == ev.token_id:
                answer = target == "content" and not self._is_special(tid)
            out += self._parsed(self._parser.push(tid))
        return answer

    def _finish(self, ev: EngineEvent) -> list[ReplyEvent]:
        out: list[ReplyEvent] = []
        if self._parser is not None:
            out += self._parsed(self._parser.finish())
            if not self._stopped:
                for kind, held in self._held.items():
                    out += self._append(kind, held) if held else []  # type: ignore[arg-type]
            self.reply.anomalies += self._parser.anomalies
        out += self._close()
        r = self.reply
        r.finish_reason, r.stop_word, r.stop_token_id = ev.finish_reason or "stop", ev.stop_word, ev.stop_token_id
        r.usage, r.timings, r.error = ev.usage, ev.timings, ev.error
        return out + [Finished(r)]

    # ---- parsed output -> blocks --------------------------------------------------------------
    def _parsed(self, events: list[OutputEvent]) -> list[ReplyEvent]:
        out: list[ReplyEvent] = []
        for pev in events:
            if pev.target == "tool_call" and pev.tool_name:
                if pev.kind == "start":
                    out += self._start("call", name=pev.tool_name, call_id=f"call_{uuid.uuid4().hex[:24]}")
                elif pev.kind == "delta" and pev.text:
                    out += self._add(pev.text)
                elif pev.kind == "end":
                    self._check_arguments()
                continue
            if pev.kind != "delta" or not pev.text or self._stopped:
                continue
            out += self._cut_at_stop("reasoning" if pev.target == "reasoning" else "text", pev.text)
        return out

    def _cut_at_stop(self, kind: Literal["reasoning", "text"], text: str) -> list[ReplyEvent]:
        """The engine cuts stop strings from the raw text; parsed text needs the same cut."""
        held = self._held[kind] + text
        hit = find_stop(held, self._stop)
        if hit is not None:
            self._stopped = True
            self._held[kind] = ""
            return self._append(kind, held[:hit]) if hit else []
        n = safe_prefix_len(held, self._stop)
        self._held[kind] = held[n:]
        return self._append(kind, held[:n]) if n else []

    def _check_arguments(self) -> None:
        block = self._open
        if block is None or block.kind != "call" or not block.text.strip():
            return
        try:
            json.loads(block.text)
        except ValueError:
            self.reply.anomalies.append(f"arguments of a call to {block.name} that are not JSON (passed on raw)")

    def _attach_answer_logprob(self, lp: TokenLogprobs, out: list[ReplyEvent]) -> None:
        """An answer token's logprobs go with the text block: on the delta of its text when this
        event has one, else alone (its text is held back and comes later)."""
        if self._open is None or self._open.kind != "text":
            out += self._start("text")
        block = self._open
        assert block is not None
        block.logprobs.append(lp)
        last = out[-1] if out else None
        if isinstance(last, BlockDelta) and last.block is block:
            out[-1] = BlockDelta(block, last.text, (*last.logprobs, lp))
        else:
            out.append(BlockDelta(block, "", (lp,)))

    # ---- blocks -------------------------------------------------------------------------------
    def _append(self, kind: Literal["reasoning", "text"], text: str) -> list[ReplyEvent]:
        out = [] if self._open is not None and self._open.kind == kind else self._start(kind)
        return out + self._add(text)

    def _add(self, text: str) -> list[ReplyEvent]:
        assert self._open is not None
        self._open.text += text
        return [BlockDelta(self._open, text)]

    def _start(self, kind: BlockKind, name: str = "", call_id: str = "") -> list[ReplyEvent]:
        out = self._close()
        self._open = Block(kind, len(self.reply.blocks), name=name, call_id=call_id)
        self.reply.blocks.append(self._open)
        return out + [BlockOpen(self._open)]

    def _close(self) -> list[ReplyEvent]:
        if self._open is None:
            return []
        block, self._open = self._open, None
        return [BlockClose(block)]
