"""Harmony, gpt-oss's chat format: the one file that spells its markup. `HarmonyFormat` is its
`ChatFormat` (tokenizer/chat_format.py); below it the token-level streaming parser.

Generation starts right after the prompt's `<|start|>assistant`, so output usually begins inside a
header: `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>`.

    state PENDING  (between messages; role known at the very start, unknown after <|start|>)
      <|start|>            -> HEADER (role read from the header text)
      <|channel|>/<|constrain|>/<|message|> -> HEADER (role assistant); pending " to=..." text joins it
      text                 -> kept while it could still be a header (" to=functions.x"), else the
                              output has no harmony structure: a plain message (content)
    state HEADER   collect tokens until <|message|>, then parse -> CONTENT   (a stop token ends an
                   empty message, or, when the header is not plausible, passes its words on as text)
    state CONTENT  text -> deltas (complete UTF-8 only); <|end|>/<|return|>/<|call|> end the message;
                   <|start|>/<|channel|> also end it (model skipped <|end|>)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from .chat_format import BudgetMarks, OutputEvent, Target, ToolCallMarks

if TYPE_CHECKING:  # the tokenizer module imports this one (for the names that end generation)
    from .tokenizer import Tokenizer

START, CHANNEL, CONSTRAIN, MESSAGE = "<|start|>", "<|channel|>", "<|constrain|>", "<|message|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
END_TOKENS = (END, RETURN, CALL)
# The names that end generation when present. <|end|> is not one: it only separates messages
# (analysis -> final), so stopping on it would cut every answer short.
GENERATION_END_NAMES = (RETURN, CALL, "<|endoftext|>")
CALL_HEADER = f"{CHANNEL}commentary to=functions"  # a tool call's header, up to the function name
ANSWER_HEADER = f"{CHANNEL}final{MESSAGE}"
THINKING_HEADER = f"{CHANNEL}analysis{MESSAGE}"


def generation_end_ids(token_id: Callable[[str], int | None], eos_id: int | None,
                       extra: Iterable[int] = ()) -> frozenset[int]:
    """Ids that end generation in a vocabulary: `extra`, its eos and harmony's stops. A converter
    may set eos = <|end|>; with harmony's real stops present it is dropped (as llama.cpp does)."""
    ids = {*extra, *(i for i in (eos_id, *map(token_id, GENERATION_END_NAMES)) if i is not None)}
    if token_id(RETURN) is not None and token_id(CALL) is not None:
        ids.discard(token_id(END))
    return frozenset(ids)


class HarmonyFormat:
    """The `ChatFormat` of templates that write harmony channels, on a vocabulary that has them."""

    name = "GPT-OSS"
    add_bos = False

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok

    @staticmethod
    def matches(template: str, tok: Tokenizer) -> bool:
        return CHANNEL in template and all(tok.token_id(t) is not None for t in (START, CHANNEL, MESSAGE, END))

    def parser(self) -> HarmonyOutput:
        return HarmonyOutput(self._tok)

    def ends_in_generation_prompt(self, prompt_ids: Sequence[int]) -> bool:
        header = [self._tok.token_id(START), *self._tok.encode("assistant", allow_special=False)]
        return list(prompt_ids[-len(header):]) == header

    def forced_call(self, name: str | None) -> str:
        return f"{CALL_HEADER}.{name} {CONSTRAIN}json{MESSAGE}" if name else CALL_HEADER

    def forced_answer(self) -> str:
        return ANSWER_HEADER

    def continuation(self, reasoning: str, content: str) -> str:
        """The message's channels written open after the generation header, as llama-server does."""
        tail = f"{THINKING_HEADER}{reasoning}" if reasoning else ""
        if content or not reasoning:
            tail += (f"{END}{START}assistant" if reasoning else "") + f"{ANSWER_HEADER}{content}"
        return tail

    def call_end_ids(self) -> tuple[int, ...] | None:
        call = self._tok.token_id(CALL)
        return (call,) if call is not None else None

    def tool_call_marks(self) -> ToolCallMarks | None:
        ids = [self._tok.token_id(t) for t in (START, END, MESSAGE, CALL, RETURN)]
        return None if None in ids else ToolCallMarks(*ids)  # type: ignore[arg-type]

    def call_header(self) -> bytes:
        return CALL_HEADER.encode()

    def budget_marks(self) -> BudgetMarks:
        return BudgetMarks(tuple(self._tok.encode(THINKING_HEADER, allow_special=True)), (self._tok.token_id(END),))


class HarmonyOutput:
    """`HarmonyParser` as a format-neutral `OutputParser`, noting what was malformed: text outside
    any message, a header without a channel, an unknown recipient, special tokens inside text (and,
    from the parser, headers or messages cut off by the next header)."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self._parser = HarmonyParser(tok)
        self.anomalies = self._parser.anomalies  # one list: the parser notes what only it sees

    @property
    def open_target(self) -> Target | None:
        header = self._parser.open_header
        return header.target if header is not None else None

    def push(self, token_id: int) -> list[OutputEvent]:
        if self.open_target is not None and self._tok.is_special(token_id) \
                and self._tok.token_text(token_id) not in (*END_TOKENS, START, CHANNEL):
            self.anomalies.append(f"special token {self._tok.token_text(token_id)} inside a message")
        return self._convert(self._parser.push(token_id))

    def finish(self) -> list[OutputEvent]:
        return self._convert(self._parser.finish())

    def _convert(self, events: list[Event]) -> list[OutputEvent]:
        out = []
        for ev in events:
            if ev.kind == "start":
                self._check(ev.header)
            out.append(OutputEvent(ev.kind, ev.target, ev.text, ev.header.tool_name))
        return out

    def _check(self, h: Header) -> None:
        if h.role is None:
            self.anomalies.append("text outside any harmony message")
        elif h.role == "assistant" and h.channel is None:
            self.anomalies.append("a message header without a channel")
        if h.recipient is not None and not h.recipient.startswith("functions."):
            self.anomalies.append(f"a message to unknown recipient {h.recipient!r}")
        elif h.recipient == "functions.":
            self.anomalies.append("a tool call without a function name")


_CONTENT_TYPES = {"json", "text", "code", "markdown"}
_CHANNELS = {"analysis", "commentary", "final"}
_CHANNEL_RE = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]*)")


@dataclass(frozen=True)
class Header:
    role: str | None = None  # assistant, or a tool name for tool output; None for plain text
    channel: str | None = None  # analysis | commentary | final | None
    recipient: str | None = None  # functions.NAME, browser.search, python, ...
    content_type: str | None = None  # json (from "<|constrain|>json" or " json")

    @property
    def target(self) -> Literal["reasoning", "content", "tool_call"]:
        """Where an OpenAI chat response puts this message's text."""
        if self.recipient and self.recipient.startswith("functions."):
            return "tool_call"
        if self.recipient or self.channel == "analysis":
            return "reasoning"  # analysis, and built-in tool calls (browser.*, python)
        return "content"  # final, commentary preamble, or unstructured text

    @property
    def tool_name(self) -> str | None:
        return self.recipient[len("functions.") :] if self.target == "tool_call" else None

    @property
    def plausible(self) -> bool:
        """A known channel and content type: a header that an end token cuts off before
        <|message|> is an empty message when plausible, else the model's text."""
        return self.channel in _CHANNELS and (self.content_type is None or self.content_type in _CONTENT_TYPES)


@dataclass(frozen=True)
class Event:
    """kind "start": header parsed; "delta": content text; "end": message finished.
    end_token is the token that ended the message ("<|end|>", "<|return|>", "<|call|>") or None
    when it was cut off (another header began, or the output finished)."""

    kind: Literal["start", "delta", "end"]
    header: Header
    text: str = ""
    end_token: str | None = None

    @property
    def channel(self) -> str | None:
        return self.header.channel

    @property
    def recipient(self) -> str | None:
        return self.header.recipient

    @property
    def content_type(self) -> str | None:
        return self.header.content_type

    @property
    def target(self) -> str:
        return self.header.target


def parse_header(text: str, role: str | None) -> Header:
    """Parse a header string (specials spelled out), e.g. `assistant<|channel|>commentary
    to=functions.f <|constrain|>json`. `role` is the already known role, or None to read it."""
    channel = None
    m = _CHANNEL_RE.search(text)
    if m:
        channel = m.group(1) or None
        text = text[: m.start()] + " " + text[m.end() :]
    text = text.replace(CONSTRAIN, " " + CONSTRAIN)
    parts = text.split()
    if role is None and parts and not parts[0].startswith(("to=", "<|")):
        role = parts.pop(0)
    elif parts and parts[0] == role:
        parts.pop(0)
    recipient = content_type = None
    for part in parts:
        if part.startswith("to="):
            recipient = part[3:] or None
        elif part.startswith(CONSTRAIN):
            content_type = part[len(CONSTRAIN) :] or None
        elif recipient is None and part not in _CONTENT_TYPES:
            recipient = part  # bare recipient, as in "<|channel|>commentary functions.f json"
        else:
            content_type = part
    return Header(role=role or "assistant", channel=channel, recipient=recipient, content_type=content_type)


class HarmonyParser:
    """Push generated token ids one at a time; get Events back. Call finish() at the end."""

    def __init__(self, tok: Tokenizer, role: str = "assistant") -> None:
        self._tok = tok
        names = (START, CHANNEL, CONSTRAIN, MESSAGE, *END_TOKENS)
        ids = {name: tok.token_id(name) for name in names}  # None where the vocab lacks one
        self._start_id = ids[START]
        self._channel_id = ids[CHANNEL]
        self._message_id = ids[MESSAGE]
        self._header_openers = {i for i in (ids[CHANNEL], ids[CONSTRAIN]) if i is not None}
        # Messages end on harmony's end tokens and on any other end-of-generation id (<|endoftext|>).
        self._end_names = {i: tok.token_text(i) for i in tok.eog_ids}
        self._end_names.update({ids[n]: n for n in END_TOKENS if ids[n] is not None})
        self._state: Literal["pending", "header", "content"] = "pending"
        self._role: str | None = role
        self._pending: list[int] = []
        self._header_ids: list[int] = []
        self._header = Header()
        self._decoder = tok.decoder()
        self._seen_message = False
        self.anomalies: list[str] = []  # malformed structure met so far (headers or messages cut off)

    # ---- public -------------------------------------------------------------------------------
    @property
    def open_header(self) -> Header | None:
        """The header of the message whose content is being read; None between messages and in headers."""
        return self._header if self._state == "content" else None

    def push(self, token_id: int) -> list[Event]:
        if self._state == "content":
            return self._push_content(token_id)
        if self._state == "header":
            return self._push_header(token_id)
        return self._push_pending(token_id)

    def feed(self, ids: Iterable[int]) -> list[Event]:
        out: list[Event] = []
        for i in ids:
            out += self.push(i)
        return out

    def finish(self) -> list[Event]:
        """End of output: close an open message (end_token None) and emit held-back text."""
        out: list[Event] = []
        if self._state == "content":
            out = self._close(None)
        elif self._state == "pending":
            out = self._flush_pending_as_text(drop_blank=True)
        # A partial header produces no text: header tokens never reach the user.
        self._state, self._pending, self._header_ids, self._role = "pending", [], [], "assistant"
        return out

    # ---- states -------------------------------------------------------------------------------
    def _push_pending(self, t: int) -> list[Event]:
        out: list[Event] = []
        if t == self._start_id:
            out += self._flush_pending_as_text(drop_blank=True)
            self._begin_header([], role=None)
        elif t in self._header_openers or t == self._message_id:
            # Pending text is always a possible header prefix (" to=functions.f"); it joins the header.
            prefix, self._pending = self._pending, []
            self._begin_header(prefix, role=self._role or "assistant")
            out += self._push_header(t)
        elif t in self._end_names:
            if self._pending:
                out += self._flush_pending_as_text(drop_blank=False, end=self._end_names[t])
        else:
            self._pending.append(t)
            if not self._pending_is_header_prefix():
                out += self._open(Header()) + self._feed_text(self._pending)
                self._pending = []
        return out

    def _push_header(self, t: int) -> list[Event]:
        if t == self._message_id:
            return self._open(self._parse_header())
        if t == self._start_id:
            self.anomalies.append("a header cut off by another")
            self._begin_header([], role=None)  # restarted header: drop the partial one
            return []
        if t in self._end_names:
            header = self._parse_header()
            if header.plausible:
                return self._open(header) + self._close(self._end_names[t])  # an empty message
            # Not a header: the model wrote prose after <|channel|> and ended; its words are text.
            words = [i for i in self._header_ids if not self._tok.is_special(i)]
            return self._open(Header()) + self._feed_text(words) + self._close(self._end_names[t])
        self._header_ids.append(t)
        return []

    def _push_content(self, t: int) -> list[Event]:
        if t in self._end_names:
            return self._close(self._end_names[t])
        if t == self._start_id:
            self.anomalies.append("a message cut off by the next header")
            out = self._close(None)
            self._begin_header([], role=None)
            return out
        if t == self._channel_id:
            self.anomalies.append("a message cut off by the next header")
            out = self._close(None)
            self._begin_header([t], role="assistant")
            return out
        return self._feed_text([t])

    # ---- helpers ------------------------------------------------------------------------------
    def _pending_is_header_prefix(self) -> bool:
        """Could the pending text still be the start of a header like " to=functions.f"?"""
        s = self._tok.decode(self._pending).lstrip()
        return s.startswith("to=") or "to=".startswith(s)

    def _flush_pending_as_text(self, drop_blank: bool, end: str | None = None) -> list[Event]:
        ids, self._pending = self._pending, []
        if not ids or (drop_blank and not self._tok.decode(ids).strip() and self._seen_message):
            return []
        return self._open(Header()) + self._feed_text(ids) + self._close(end)

    def _begin_header(self, ids: list[int], role: str | None) -> None:
        self._state, self._header_ids, self._role = "header", list(ids), role

    def _parse_header(self) -> Header:
        return parse_header(self._tok.decode(self._header_ids), self._role)

    def _open(self, header: Header) -> list[Event]:
        self._state, self._header, self._seen_message = "content", header, True
        self._decoder = self._tok.decoder()
        return [Event("start", header)]

    def _feed_text(self, ids: Iterable[int]) -> list[Event]:
        text = "".join(self._decoder.push(i) for i in ids)
        return [Event("delta", self._header, text)] if text else []

    def _close(self, end_token: str | None) -> list[Event]:
        out: list[Event] = []
        rest = self._decoder.flush()
        if rest:
            out.append(Event("delta", self._header, rest))
        out.append(Event("end", self._header, end_token=end_token))
        self._state, self._role = "pending", None
        return out


# ---- non-streaming ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments_json: str


@dataclass(frozen=True)
class Message:
    header: Header
    text: str
    end_token: str | None


@dataclass
class ParsedOutput:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)

    @property
    def last_end_token(self) -> str | None:
        return self.messages[-1].end_token if self.messages else None


def collect(events: Iterable[Event]) -> ParsedOutput:
    """Fold parser events into the OpenAI-style split (same rules the streaming deltas follow)."""
    out = ParsedOutput()
    text: list[str] = []
    for ev in events:
        if ev.kind == "start":
            text = []
        elif ev.kind == "delta":
            text.append(ev.text)
            if ev.target == "reasoning":
                out.reasoning += ev.text
            elif ev.target == "content":
                out.content += ev.text
        else:
            body = "".join(text)
            out.messages.append(Message(ev.header, body, ev.end_token))
            if ev.target == "tool_call":
                out.tool_calls.append(ToolCall(ev.header.tool_name or "", body))
    return out


def parse_completion(tok: Tokenizer, ids: Iterable[int]) -> ParsedOutput:
    """Parse a whole generated sequence (stop token included or not)."""
    parser = HarmonyParser(tok)
    return collect(parser.feed(ids) + parser.finish())


def render_reasoning_none(tok: Tokenizer, ids: Iterable[int]) -> str:
    """The raw text llama-server returns with `--reasoning-format none`: markup included, the
    final stop token (<|return|>/<|call|>/eos) left out."""
    ids = list(ids)
    if ids and ids[-1] in tok.eog_ids:
        ids = ids[:-1]
    return tok.decode(ids)
