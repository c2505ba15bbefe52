"""JSON mode (`response_format: {"type": "json_object"}`): an incremental, byte-level JSON
recognizer that says which tokens may come next, so sampling only ever extends a valid JSON text.

The recognizer walks RFC 8259 JSON one byte at a time with a stack of open containers; its whole
state is a few small fields, so checking a candidate token is: copy the state, feed the token's
bytes, see whether it failed. Strings must be well-formed UTF-8 (a character may be split across
tokens). The top-level value must be an object (OpenAI's JSON mode); surrounding whitespace is
allowed, and once the object is closed only end-of-generation tokens are. Runs of whitespace
between tokens are capped (MAX_WS bytes) so a model cannot stall in an endless run of newlines.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

_WS = frozenset(b" \t\n\r")
MAX_WS = 32
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrtu')

# Modes: what the next byte may be.
_VALUE, _FIRST_KEY, _KEY, _COLON, _AFTER_VALUE, _FIRST_ITEM, _STRING, _ESCAPE, _LITERAL, _NUMBER, _DONE = range(11)
# Number sub-states (which part was last read).
_N_SIGN, _N_ZERO, _N_INT, _N_DOT, _N_FRAC, _N_E, _N_ESIGN, _N_EXP = range(8)
_NUMBER_ENDS = (_N_ZERO, _N_INT, _N_FRAC, _N_EXP)


class JsonState:
    """Mutable recognizer state. `feed` returns False (and leaves the state undefined) on the
    first byte that cannot continue a JSON object text."""

    __slots__ = ("mode", "stack", "aux", "key", "u8", "u8lo", "u8hi", "ws")

    def __init__(self) -> None:
        self.mode = _VALUE
        self.stack: list[int] = []  # open containers: ord("{") or ord("[")
        self.aux: int | bytes = 0  # _NUMBER: sub-state; _LITERAL: bytes still expected; _ESCAPE: hex left
        self.key = False  # the open string is an object key
        self.u8 = 0  # UTF-8 continuation bytes still due in the open string,
        self.u8lo, self.u8hi = 0x80, 0xBF  # and the range the next one must fall in
        self.ws = 0  # length of the current whitespace run between tokens

    def copy(self) -> JsonState:
        s = JsonState.__new__(JsonState)
        s.mode, s.stack, s.aux, s.key = self.mode, list(self.stack), self.aux, self.key
        s.u8, s.u8lo, s.u8hi, s.ws = self.u8, self.u8lo, self.u8hi, self.ws
        return s

    @property
    def done(self) -> bool:
        return self.mode == _DONE

    def feed(self, data: bytes) -> bool:
        for b in data:
            if not self._byte(b):
                return False
        return True

    def _close_value(self) -> None:
        self.mode = _AFTER_VALUE if self.stack else _DONE

    def _byte(self, b: int) -> bool:
        m = self.mode
        if m == _STRING:
            if self.u8:
                if not self.u8lo <= b <= self.u8hi:
                    return False
                self.u8, self.u8lo, self.u8hi = self.u8 - 1, 0x80, 0xBF
                return True
            if b >= 0x80:
                return self._utf8_lead(b)
            if b == 0x22:  # "
                if self.key:
                    self.mode = _COLON
                else:
                    self._close_value()
                return True
            if b == 0x5C:  # backslash
                self.mode, self.aux = _ESCAPE, 0
                return True
            return b >= 0x20
        if m == _ESCAPE:
            if self.aux:  # inside \uXXXX
                if b not in _HEX:
                    return False
                self.aux -= 1
                if not self.aux:
                    self.mode = _STRING
                return True
            if b not in _ESCAPES:
                return False
            if b == 0x75:  # u
                self.aux = 4
            else:
                self.mode = _STRING
            return True
        if m == _NUMBER:
            if self._number(b):
                return True
            if self.aux not in _NUMBER_ENDS:
                return False
            self._close_value()  # the number ended: this byte belongs to what follows
            return self._byte(b)
        if m == _LITERAL:
            rest = self.aux
            if b != rest[0]:
                return False
            self.aux = rest[1:]
            if not self.aux:
                self._close_value()
            return True
        if b in _WS:
            self.ws += 1
            return self.ws <= MAX_WS
        self.ws = 0
        if m == _VALUE or m == _FIRST_ITEM:
            if m == _FIRST_ITEM and b == 0x5D:  # ]
                return self._pop(0x5B)
            if not self.stack and b != 0x7B:  # the top level must be an object
                return False
            return self._start_value(b)
        if m == _FIRST_KEY or m == _KEY:
            if m == _FIRST_KEY and b == 0x7D:  # }
                return self._pop(0x7B)
            if b != 0x22:
                return False
            self.mode, self.key = _STRING, True
            return True
        if m == _COLON:
            if b != 0x3A:
                return False
            self.mode = _VALUE
            return True
        if m == _AFTER_VALUE:
            top = self.stack[-1]
            if b == 0x2C:  # ,
                self.mode = _KEY if top == 0x7B else _VALUE
                return True
            return self._pop(0x7B if b == 0x7D else 0x5B if b == 0x5D else -1)
        return False  # _DONE: nothing but whitespace (handled above)

    def _utf8_lead(self, b: int) -> bool:
        """A multi-byte character's first byte: no overlongs, surrogates or code points > U+10FFFF."""
        if 0xC2 <= b <= 0xDF:
            self.u8 = 1
        elif 0xE0 <= b <= 0xEF:
            self.u8 = 2
            self.u8lo, self.u8hi = (0xA0, 0xBF) if b == 0xE0 else (0x80, 0x9F) if b == 0xED else (0x80, 0xBF)
        elif 0xF0 <= b <= 0xF4:
            self.u8 = 3
            self.u8lo, self.u8hi = (0x90, 0xBF) if b == 0xF0 else (0x80, 0x8F) if b == 0xF4 else (0x80, 0xBF)
        else:
            return False
        return True

    def _pop(self, opener: int) -> bool:
        if not self.stack or self.stack[-1] != opener:
            return False
        self.stack.pop()
        self._close_value()
        return True

    def _start_value(self, b: int) -> bool:
        if b == 0x7B or b == 0x5B:
            self.stack.append(b)
            self.mode = _FIRST_KEY if b == 0x7B else _FIRST_ITEM
        elif b == 0x22:
            self.mode, self.key = _STRING, False
        elif b == 0x2D or b in _DIGITS:
            self.mode = _NUMBER
            self.aux = _N_SIGN if b == 0x2D else _N_ZERO if b == 0x30 else _N_INT
        elif b in b"tfn":
            self.mode, self.aux = _LITERAL, {0x74: b"rue", 0x66: b"alse", 0x6E: b"ull"}[b]
        else:
            return False
        return True

    def _number(self, b: int) -> bool:
        s = self.aux
        digit = b in _DIGITS
        if s == _N_SIGN:
            nxt = (_N_ZERO if b == 0x30 else _N_INT) if digit else None
        elif s in (_N_ZERO, _N_INT):
            nxt = _N_INT if digit and s == _N_INT else _N_DOT if b == 0x2E else _N_E if b in b"eE" else None
        elif s in (_N_DOT, _N_FRAC):
            nxt = _N_FRAC if digit else _N_E if s == _N_FRAC and b in b"eE" else None
        elif s == _N_E:
            nxt = _N_EXP if digit else _N_ESIGN if b in b"+-" else None
        else:  # _N_ESIGN, _N_EXP
            nxt = _N_EXP if digit else None
        if nxt is None:
            return False
        self.aux = nxt
        return True


class JsonConstraint:
    """Per-request JSON mode (with or without a schema) for the sampler: `allowed(token)` for candidates, `advance(token)`
    for the chosen one. End-of-generation tokens are allowed exactly when the object is complete;
    other special tokens never are."""

    def __init__(self, token_bytes: Callable[[int], bytes], end_ids: Iterable[int], special_ids: Iterable[int],
                 state: Any = None):
        """state: the recognizer (feed / copy / done): a JsonState (any object) by default, or a
        json_schema.SchemaState."""
        self._bytes = token_bytes
        self.end_ids = frozenset(end_ids)
        self._special = frozenset(special_ids)
        self.state = JsonState() if state is None else state

    @property
    def done(self) -> bool:
        return self.state.done

    def allowed(self, token: int) -> bool:
        if token in self.end_ids:
            return self.state.done
        if token in self._special:
            return False
        data = self._bytes(token)
        return bool(data) and self.state.copy().feed(data)

    def advance(self, token: int) -> None:
        if token in self.end_ids:
            return
        if not self.state.feed(self._bytes(token)):
            raise ValueError(f"token {token} does not continue the JSON text")
