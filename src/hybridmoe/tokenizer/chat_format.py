"""The chat format a model writes its replies in: one object, chosen once at load (`choose_format`).

A format owns its markup, so nothing else in the project spells it: what is written after the
generation prompt to continue an assistant message or to force a tool call or a direct answer,
the tokens that open and close thinking (reasoning budgets), the tokens of its tool-call syntax
(lazy tool-call grammars), and the streaming parser that splits a reply into reasoning, answer
text and tool calls. The formats are listed in `FORMATS` (tokenizer/formats.py), tried in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

Target = Literal["reasoning", "content", "tool_call"]


@dataclass(frozen=True)
class OutputEvent:
    """One step of a parsed reply. kind "start": a message opens (its target known); "delta": its
    text (a call's arguments for a tool call); "end": it closed."""

    kind: Literal["start", "delta", "end"]
    target: Target
    text: str = ""
    tool_name: str | None = None  # tool_call: the function called


class OutputParser(Protocol):
    """Token ids in, `OutputEvent`s out, one token at a time; `finish()` at the end of the reply."""

    @property
    def open_target(self) -> Target | None:
        """Where the text of the message being read goes (None between messages and in headers)."""

    @property
    def anomalies(self) -> list[str]:
        """What the parser had to guess about so far (malformed output), for the server's log."""

    def push(self, token_id: int) -> list[OutputEvent]: ...

    def finish(self) -> list[OutputEvent]: ...


@dataclass(frozen=True)
class ToolCallMarks:
    """Token ids of a format's tool-call syntax, for the engine's lazy tool-call grammar: a
    message starts (`start`), ends (`end`), its header ends (`message`), a call ends (`call`),
    the reply ends (`ret`)."""

    start: int
    end: int
    message: int
    call: int
    ret: int


@dataclass(frozen=True)
class BudgetMarks:
    """Token ids that open thinking and close it (what a reasoning budget writes when spent)."""

    start: tuple[int, ...]
    end: tuple[int, ...]


class ChatFormat(Protocol):
    name: str  # as /slots reports it
    add_bos: bool  # /tokenize's add_special puts BOS first (harmony prompts never start with it)

    def parser(self) -> OutputParser:
        """A parser for one reply."""

    def ends_in_generation_prompt(self, prompt_ids: Sequence[int]) -> bool:
        """The prompt ends where the model's reply begins (so a prefix may be written for it)."""

    def forced_call(self, name: str | None) -> str | None:
        """Text written for the model so the reply is a tool call (`name`: to that function; None:
        to one the model names); None when the format has no syntax to force one."""

    def forced_answer(self) -> str | None:
        """Text written for the model so it answers without thinking; None when nothing is needed."""

    def continuation(self, reasoning: str, content: str) -> str | None:
        """What follows the generation prompt when a final assistant message is continued; None:
        cut the template's own rendering of the message where its content ends."""

    def call_end_ids(self) -> tuple[int, ...] | None:
        """Tokens that end a forced call's arguments (None: the reply's end-of-generation ids)."""

    def tool_call_marks(self) -> ToolCallMarks | None:
        """The tokens of the tool-call syntax, or None when tool calls cannot be constrained."""

    def call_header(self) -> bytes:
        """What `forced_call(None)` writes, as the lazy tool-call grammar matches it."""

    def budget_marks(self) -> BudgetMarks | None:
        """Thinking's opening and closing tokens, or None when the format does not think."""
