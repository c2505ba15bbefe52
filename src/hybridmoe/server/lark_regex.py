"""A Lark grammar without recursion -> one regular expression.

A freeform (`custom`) Responses tool such as Codex's `apply_patch` declares its input as a Lark
grammar, and this server hands that input to the model as a JSON string. llguidance can hold a JSON
string to a regex (escaping included) but cannot nest a Lark grammar inside one; a grammar that
never refers back to itself is regular, so it is rewritten as a regex. Anything else (recursion,
`%ignore`, features not listed here) raises `NotRegular`, and the caller goes without the constraint.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable

MAX_PATTERN_CHARS = 32 * 1024  # the regex's size; apply_patch's is ~400 characters
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_DEPTH = 64  # nesting of groups and rule references

# Lark's `%import common.NAME` terminals that are regular (lark/grammars/common.lark).
_COMMON = {
    "LF": r"\n", "CR": r"\r", "CRLF": r"\r\n", "NEWLINE": r"(?:\r?\n)+", "WS_INLINE": r"[ \t]+",
    "WS": r"[ \t\f\r\n]+", "DIGIT": r"[0-9]", "HEXDIGIT": r"[a-fA-F0-9]", "INT": r"[0-9]+",
    "SIGNED_INT": r"[+-]?[0-9]+", "LCASE_LETTER": r"[a-z]", "UCASE_LETTER": r"[A-Z]",
    "LETTER": r"[A-Za-z]", "WORD": r"[A-Za-z]+", "CNAME": r"[_A-Za-z][_A-Za-z0-9]*",
    "DECIMAL": r"(?:[0-9]+\.[0-9]*|\.[0-9]+)", "NUMBER": r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?",
    "ESCAPED_STRING": r'"(?:[^"\\]|\\.)*"',
}
_TOKEN = re.compile(r'\s*(?:(?P<str>"(?:\\.|[^"\\])*"i?)|(?P<re>/(?:\\.|[^/\\])+/[imslux]*)|(?P<arrow>->)'
                    r'|(?P<range>\.\.)|(?P<num>\d+)|(?P<name>[?!]?[A-Za-z_][A-Za-z_0-9]*)|(?P<op>[()\[\]|?*+~]))')
_DEFINITION = re.compile(r"^([?!]?[A-Za-z_][A-Za-z_0-9]*)(?:\.-?\d+)?\s*:\s*(.*)$", re.S)
_META = set("\\.+*?()|[]{}^$#&-~")


class NotRegular(ValueError):
    """The grammar uses something a single regex cannot say (or this converter does not know)."""


def lark_to_regex(grammar: str, start: str = "start") -> str:
    """The regex that matches exactly the texts `grammar` (from its `start` rule) derives."""
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise NotRegular(f"the grammar has {len(grammar)} characters")
    rules = _definitions(grammar)
    if start not in rules:
        raise NotRegular(f"the grammar has no '{start}' rule")
    return _Converter(rules).rule(start)


def _definitions(grammar: str) -> dict[str, str]:
    """Rule and terminal bodies by name (continuation lines joined; imports resolved)."""
    chunks: list[str] = []
    for line in grammar.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("//"):
            continue
        if chunks and (line[:1].isspace() or stripped.startswith("|")):
            chunks[-1] += " " + stripped
        else:
            chunks.append(stripped)
    rules: dict[str, str] = {}
    for chunk in chunks:
        if chunk.startswith("%import"):
            for alias, name in _imports(chunk):
                rules[alias] = f"/{_COMMON[name]}/"
            continue
        if chunk.startswith("%"):
            raise NotRegular(f"unsupported directive {chunk.split()[0]}")
        m = _DEFINITION.match(chunk)
        if m is None:
            raise NotRegular(f"cannot read the definition {chunk[:60]!r}")
        rules[m.group(1).lstrip("?!")] = m.group(2)
    return rules


def _imports(chunk: str) -> list[tuple[str, str]]:
    """(name in the grammar, common terminal) for `%import common.LF`, `%import common.WS -> SPACE`,
    `%import common (LF, WS)`."""
    m = re.fullmatch(r"%import\s+common\s*(?:\.\s*(\w+)(?:\s*->\s*(\w+))?|\(([\w\s,]+)\))", chunk)
    if m is None:
        raise NotRegular(f"unsupported import {chunk[:60]!r}")
    pairs = [(m.group(2) or m.group(1), m.group(1))] if m.group(1) else \
        [(n.strip(), n.strip()) for n in m.group(3).split(",") if n.strip()]
    for _, name in pairs:
        if name not in _COMMON:
            raise NotRegular(f"unsupported import common.{name}")
    return pairs


def _escape(text: str) -> str:
    out = []
    for ch in text:
        if ch in _META:
            out.append("\\" + ch)
        elif ch in "\n\t\r":
            out.append({"\n": r"\n", "\t": r"\t", "\r": r"\r"}[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{{{ord(ch):x}}}")
        else:
            out.append(ch)
    return "".join(out)


class _Converter:
    """Recursive descent over one rule body at a time, inlining the rules it names."""

    def __init__(self, rules: dict[str, str]) -> None:
        self.rules = rules
        self.done: dict[str, str] = {}
        self.open: set[str] = set()
        self.tokens: list[tuple[str, str]] = []
        self.pos = 0
        self.depth = 0

    @staticmethod
    def _bounded(text: str) -> str:
        """Inlining can grow the regex exponentially (each rule naming the last twice): stop early."""
        if len(text) > MAX_PATTERN_CHARS:
            raise NotRegular(f"the grammar's regex would exceed {MAX_PATTERN_CHARS} characters")
        return text

    def rule(self, name: str) -> str:
        if name in self.done:
            return self.done[name]
        if name in self.open:
            raise NotRegular(f"'{name}' refers to itself")
        if name not in self.rules:
            raise NotRegular(f"'{name}' is not defined")
        self.open.add(name)
        saved = self.tokens, self.pos
        self.tokens, self.pos = _tokens(self.rules[name]), 0
        out = self.nested(self.alternatives)
        if self.pos != len(self.tokens):
            raise NotRegular(f"cannot read '{name}' past {self.tokens[self.pos][1]!r}")
        self.tokens, self.pos = saved
        self.open.discard(name)
        self.done[name] = out = f"(?:{out})"
        return out

    def nested(self, parse: Callable[[], str]) -> str:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise NotRegular(f"the grammar nests deeper than {MAX_DEPTH}")
        try:
            return parse()
        finally:
            self.depth -= 1

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, kind: str, text: str | None = None) -> str:
        tok = self.peek()
        if tok is None or tok[0] != kind or (text is not None and tok[1] != text):
            raise NotRegular(f"expected {text or kind}, got {tok[1] if tok else 'the end'!r}")
        self.pos += 1
        return tok[1]

    def alternatives(self) -> str:
        out = self.sequence()
        while self.peek() == ("op", "|"):
            self.pos += 1
            out = self._bounded(out + "|" + self.sequence())
        return out

    def sequence(self) -> str:
        out = ""
        while (tok := self.peek()) is not None and tok not in (("op", "|"), ("op", ")"), ("op", "]")):
            if tok[0] == "arrow":  # `-> alias`: a tree label, no text
                self.pos += 1
                self.take("name")
                continue
            out = self._bounded(out + self.repeated())
        return out

    def repeated(self) -> str:
        atom = self.atom()
        tok = self.peek()
        if tok in (("op", "?"), ("op", "*"), ("op", "+")):
            self.pos += 1
            return f"(?:{atom}){tok[1]}"
        if tok == ("op", "~"):
            self.pos += 1
            low = self.take("num")
            high = low
            if self.peek() == ("range", ".."):
                self.pos += 1
                high = self.take("num")
            return f"(?:{atom}){{{low},{high}}}"
        return atom

    def atom(self) -> str:
        kind, text = self.peek() or ("end", "")
        self.pos += 1
        if (kind, text) in (("op", "("), ("op", "[")):
            inner = self.nested(self.alternatives)
            self.take("op", ")" if text == "(" else "]")
            return f"(?:{inner})" if text == "(" else f"(?:{inner})?"
        if kind == "str":
            literal = _literal(text)
            if self.peek() == ("range", ".."):
                self.pos += 1
                last = _literal(self.take("str"))
                if len(literal) != 1 or len(last) != 1:
                    raise NotRegular("a range needs single characters")
                return f"[{_escape(literal)}-{_escape(last)}]"
            body = _escape(literal)
            return f"(?i:{body})" if text.endswith("i") else f"(?:{body})"
        if kind == "re":
            body, flags = text[1:].rsplit("/", 1)
            if set(flags) - {"i"}:
                raise NotRegular(f"unsupported regex flags {flags!r}")
            body = body.replace("\\/", "/")
            return f"(?i:{body})" if flags else f"(?:{body})"
        if kind == "name":
            return self.rule(text.lstrip("?!"))
        raise NotRegular(f"unexpected {text or 'end'!r}")


def _tokens(body: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(body):
        if body[pos:].strip() == "":
            break
        m = _TOKEN.match(body, pos)
        if m is None or m.end() == pos:
            raise NotRegular(f"cannot read {body[pos:pos + 30]!r}")
        kind = m.lastgroup or "op"
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


def _literal(token: str) -> str:
    """A Lark string literal's text (Python escapes; a trailing `i` flag dropped)."""
    try:
        value = ast.literal_eval(token[:-1] if token.endswith("i") else token)
    except (ValueError, SyntaxError) as e:
        raise NotRegular(f"cannot read the literal {token[:40]}") from e
    if not isinstance(value, str):
        raise NotRegular(f"cannot read the literal {token[:40]}")
    return value
