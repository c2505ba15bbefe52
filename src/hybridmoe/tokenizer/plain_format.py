"""The plain chat format: any template without channels (ChatML and the like). No thinking; the
reply is answer text, and tool calls follow one JSON convention, the one Hermes- and Qwen-style
templates teach their models:

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

one call per tag, any number of tags, text around them is answer text. A tag whose body is not
such an object is answer text too (noted as malformed output).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from .chat_format import OutputEvent, Target
from .tokenizer import Tokenizer

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


class PlainFormat:
    """The `ChatFormat` of every template the table has nothing more specific for."""

    name = "Content-only"
    add_bos = True

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok

    @staticmethod
    def matches(template: str, tok: Tokenizer) -> bool:
        return True

    def parser(self) -> PlainOutput:
        return PlainOutput(self._tok)

    def ends_in_generation_prompt(self, prompt_ids: Sequence[int]) -> bool:
        return True

    def forced_call(self, name: str | None) -> None:
        return None

    def forced_answer(self) -> None:
        return None

    def continuation(self, reasoning: str, content: str) -> None:
        return None

    def call_end_ids(self) -> None:
        return None

    def tool_call_marks(self) -> None:
        return None

    def call_header(self) -> bytes:
        return b""

    def budget_marks(self) -> None:
        return None


class PlainOutput:
    """Streams answer text, holding back what could still be the start of a `<tool_call>` tag."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self._decoder = tok.decoder()
        self._held = ""  # text not yet emitted: a possible tag start, or a call's body
        self._in_call = False
        self._text_open = False
        self.anomalies: list[str] = []

    @property
    def open_target(self) -> Target | None:
        return "tool_call" if self._in_call else "content"

    def push(self, token_id: int) -> list[OutputEvent]:
        if token_id in self._tok.eog_ids:
            return []
        self._held += self._decoder.push(token_id)
        return self._scan()

    def finish(self) -> list[OutputEvent]:
        self._held += self._decoder.flush()
        out = self._scan()
        if self._in_call:
            self.anomalies.append(f"a {CALL_OPEN} tag without its {CALL_CLOSE}")
            out += self._text(CALL_OPEN + self._held)
            self._held, self._in_call = "", False
        out += self._text(self._held)
        self._held = ""
        if self._text_open:
            self._text_open = False
            out.append(OutputEvent("end", "content"))
        return out

    def _scan(self) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        while True:
            if self._in_call:
                cut = self._held.find(CALL_CLOSE)
                if cut < 0:
                    return out
                body, self._held = self._held[:cut], self._held[cut + len(CALL_CLOSE):]
                self._in_call = False
                out += self._call(body)
                continue
            cut = self._held.find(CALL_OPEN)
            if cut < 0:
                keep = _partial_suffix(self._held, CALL_OPEN)
                text, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
                return out + self._text(text)
            out += self._text(self._held[:cut])
            self._held, self._in_call = self._held[cut + len(CALL_OPEN):], True

    def _text(self, text: str) -> list[OutputEvent]:
        if not text:
            return []
        out = [] if self._text_open else [OutputEvent("start", "content")]
        self._text_open = True
        return out + [OutputEvent("delta", "content", text)]

    def _call(self, body: str) -> list[OutputEvent]:
        try:
            call = json.loads(body)
        except ValueError:
            call = None
        name = call.get("name") if isinstance(call, dict) else None
        if not isinstance(name, str) or not name:
            self.anomalies.append(f"a {CALL_OPEN} whose body is not {{\"name\": ..., \"arguments\": ...}}")
            return self._text(CALL_OPEN + body + CALL_CLOSE)
        args = call.get("arguments", {})
        out = []
        if self._text_open:
            self._text_open = False
            out.append(OutputEvent("end", "content"))
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        return out + [OutputEvent("start", "tool_call", tool_name=name),
                      OutputEvent("delta", "tool_call", text, tool_name=name),
                      OutputEvent("end", "tool_call", tool_name=name)]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back: the tag may follow)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
