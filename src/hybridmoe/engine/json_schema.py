"""JSON mode with a schema (`response_format: {"type": "json_schema", ...}`): a byte-level
recognizer of the JSON texts a schema admits, for the constrained sampler (see json_constraint).

Enforced: `type` (one or a list), `properties` / `required` / `additionalProperties`, `items` /
`minItems` / `maxItems`, `enum` / `const`, `$ref` into `$defs` / `definitions` (recursion allowed),
`anyOf` / `oneOf` whose branches start differently (object / array / string / number / literal).
An object with `properties` and no `additionalProperties` admits no other keys (structured-output
intent). Not enforced (accepted, ignored): `pattern`, `format`, lengths and numeric ranges.
The root must be an object or an array. Unsupported constructs raise SchemaError.
`object_state()` recognizes any JSON object (plain JSON mode). Strings must be well-formed UTF-8
(a character may be split across tokens); whitespace runs between tokens are capped (MAX_WS).
"""

from __future__ import annotations

import json
from typing import Any


_WS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
MAX_WS = 32  # longest whitespace run between tokens: a model cannot stall in endless newlines
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrtu')
_START = {"object": b"{", "array": b"[", "string": b'"', "number": b"-0123456789", "integer": b"-0123456789",
          "boolean": b"tf", "null": b"n"}
_PRIMITIVE = ("object", "array", "string", "number", "integer", "boolean", "null")

NUMBER_ENDS = ("zero", "int", "frac", "exp")  # number parts after which the number may end


def number_start(b: int) -> str:
    """The number part after its first byte (`-` or a digit)."""
    return "sign" if b == 0x2D else "zero" if b == 0x30 else "int"


def number_next(part: str, b: int, integer: bool = False) -> str | None:
    """The number part after byte b, or None when b cannot continue the number."""
    digit = b in _DIGITS
    if part == "sign":
        return ("zero" if b == 0x30 else "int") if digit else None
    if part in ("zero", "int"):
        if digit:
            return "int" if part == "int" else None  # no leading zeros
        if integer:
            return None
        return "dot" if b == 0x2E else "e" if b in b"eE" else None
    if part in ("dot", "frac"):
        return "frac" if digit else "e" if part == "frac" and b in b"eE" else None
    if part == "e":
        return "exp" if digit else "esign" if b in b"+-" else None
    return "exp" if digit else None  # esign, exp


def utf8_lead(b: int) -> tuple[int, int, int] | None:
    """(continuation bytes due, lowest, highest allowed next byte) for a multi-byte character's
    first byte; None for bytes that cannot start one (no overlongs, surrogates, > U+10FFFF)."""
    if 0xC2 <= b <= 0xDF:
        return 1, 0x80, 0xBF
    if 0xE0 <= b <= 0xEF:
        return (2, *((0xA0, 0xBF) if b == 0xE0 else (0x80, 0x9F) if b == 0xED else (0x80, 0xBF)))
    if 0xF0 <= b <= 0xF4:
        return (3, *((0x90, 0xBF) if b == 0xF0 else (0x80, 0x8F) if b == 0xF4 else (0x80, 0xBF)))
    return None


class SchemaError(ValueError):
    """The schema uses something this recognizer cannot enforce."""


# ---------------------------------------------------------------------------------------- compile
def compile_schema(schema: Any) -> dict:
    """Schema dict -> node graph (dicts with a "kind"); SchemaError when unsupported."""
    if not isinstance(schema, dict):
        raise SchemaError("the schema must be a JSON object")
    defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    memo: dict[str, dict] = {}
    try:
        root = _compile(schema, defs, memo)
    except RecursionError:
        raise SchemaError("the schema is nested too deeply") from None
    if _first_bytes(root, set()) - set(b"{["):
        raise SchemaError("the schema's root must be an object or an array")
    return root


def _compile(s: Any, defs: dict, memo: dict[str, dict]) -> dict:
    if s is True or s == {}:
        return {"kind": "any"}
    if not isinstance(s, dict):
        raise SchemaError(f"unsupported schema {s!r}")
    if "$ref" in s:
        ref = s["$ref"]
        name = ref.rsplit("/", 1)[-1] if isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")) else None
        if name is None or name not in defs:
            raise SchemaError(f"unsupported or unknown $ref {ref!r} (only #/$defs/... and #/definitions/...)")
        if name not in memo:
            memo[name] = {"kind": "ref"}  # filled below; recursion reaches this placeholder
            memo[name].update(_compile(defs[name], defs, memo))
        return memo[name]
    if "const" in s or "enum" in s:
        values = [s["const"]] if "const" in s else s["enum"]
        if not isinstance(values, list) or not values:
            raise SchemaError("enum must be a non-empty list")
        texts = sorted({json.dumps(v, separators=(",", ":"), ensure_ascii=False).encode() for v in values})
        return {"kind": "literals", "texts": texts}
    for key in ("anyOf", "oneOf"):
        if key in s:
            return _union([_compile(b, defs, memo) for b in s[key]])
    t = s.get("type")
    if isinstance(t, list):
        return _union([_compile({**s, "type": x}, defs, memo) for x in t])
    if t is None:
        if "properties" in s:
            t = "object"
        elif "items" in s:
            t = "array"
        else:
            return {"kind": "any"}
    if t not in _PRIMITIVE:
        raise SchemaError(f"unsupported type {t!r}")
    if t == "object":
        props = s.get("properties", {})
        if not isinstance(props, dict):
            raise SchemaError("properties must be an object")
        required = s.get("required", [])
        if not isinstance(required, list) or any(r not in props for r in required):
            raise SchemaError("required must list names from properties")
        extra = s.get("additionalProperties", False if props else True)
        for name in props:
            if "\\" in json.dumps(name, ensure_ascii=False)[1:-1]:
                raise SchemaError(f"property name {name!r} needs escapes: unsupported")
        return {"kind": "object",
                "props": {n.encode(): _compile(p, defs, memo) for n, p in props.items()},
                "required": {r.encode() for r in required},
                "extra": None if extra is False else _compile(extra, defs, memo)}
    if t == "array":
        lo, hi = int(s.get("minItems", 0)), s.get("maxItems")
        return {"kind": "array", "items": _compile(s.get("items", True), defs, memo), "min": lo,
                "max": None if hi is None else int(hi)}
    return {"kind": t}


def _first_bytes(node: dict, seen: set) -> set[int]:
    if id(node) in seen:
        return set()
    seen.add(id(node))
    k = node["kind"]
    if k == "union":
        return set().union(*(_first_bytes(b, seen) for b in node["branches"]))
    if k == "literals":
        return {t[0] for t in node["texts"]}
    if k == "any":
        return set(b'{["-0123456789tfn')
    if k == "ref":
        raise SchemaError("a recursive $ref inside anyOf / oneOf / a type list is not supported")
    return set(_START[k])


def _union(branches: list[dict]) -> dict:
    taken: set[int] = set()
    for b in branches:
        first = _first_bytes(b, set())
        if first & taken:
            raise SchemaError("anyOf / oneOf / type lists whose branches can start alike are not supported")
        taken |= first
    return {"kind": "union", "branches": branches}


# -------------------------------------------------------------------------------------- recognize
# Frames are lists, [kind, node or flag, ...state]; copy() copies them per candidate token.
_CONSUMED, _REJECT, _POP = 0, 1, 2


class SchemaState:
    """Recognizer for one compiled schema: `feed(bytes)` (False at the first byte the schema
    does not admit; the state is then undefined), `done`, `copy()`."""

    __slots__ = ("stack", "ws", "started")

    def __init__(self, root: dict) -> None:
        self.stack: list[list] = [["value", root]]
        self.ws = 0
        self.started = False

    def copy(self) -> SchemaState:
        s = SchemaState.__new__(SchemaState)
        # Frames hold ints, bytes, frozensets, shared schema nodes, and (keys) a nested lexer list.
        s.stack = [[list(x) if type(x) is list else x for x in f] for f in self.stack]
        s.ws, s.started = self.ws, self.started
        return s

    @property
    def done(self) -> bool:
        return self.started and not self.stack

    def feed(self, data: bytes) -> bool:
        for b in data:
            if not self._byte(b):
                return False
        return True

    def _byte(self, b: int) -> bool:
        while True:
            if not self.stack:  # the root value is complete: trailing whitespace only
                return self._space(b)
            f = self.stack[-1]
            r = getattr(self, "_" + f[0])(f, b)
            if r == _POP:
                self.stack.pop()
                continue  # the finished frame did not take b: its parent gets it
            return r == _CONSUMED

    def _space(self, b: int) -> bool:
        if b in _WS:
            self.ws += 1
            return self.ws <= MAX_WS
        return False

    # value: dispatch on the first byte
    def _value(self, f: list, b: int) -> int:
        if b in _WS:
            return _CONSUMED if self._space(b) else _REJECT
        self.ws = 0
        node = f[1]
        while node["kind"] == "union":
            node = next((x for x in node["branches"] if b in _first_bytes(x, set())), None)
            if node is None:
                return _REJECT
        k = node["kind"]
        if k == "any":
            k = {0x7B: "object", 0x5B: "array", 0x22: "string", 0x74: "boolean", 0x66: "boolean",
                 0x6E: "null"}.get(b, "number")
            node = {"kind": k, "props": {}, "required": set(), "extra": {"kind": "any"},
                    "items": {"kind": "any"}, "min": 0, "max": None}
        self.started = True
        if k in ("boolean", "null", "literals"):
            texts = node["texts"] if k == "literals" else [b"true", b"false"] if k == "boolean" else [b"null"]
            self.stack[-1] = ["literal", texts, b""]
            return self._literal(self.stack[-1], b)
        if b not in _START[k]:
            return _REJECT
        if k == "object":
            self.stack[-1] = ["object", node, "first", frozenset(), b""]
        elif k == "array":
            self.stack[-1] = ["array", node, "first", 0]
        elif k == "string":
            self.stack[-1] = ["string", 0, 0x80, 0xBF, 0]  # [kind, utf8 due, lo, hi, hex due]
        else:
            self.stack[-1] = ["number", k == "integer", number_start(b)]
        return _CONSUMED

    def _literal(self, f: list, b: int) -> int:
        typed = f[2] + bytes([b])
        if any(t.startswith(typed) for t in f[1]):
            f[2] = typed
            return _CONSUMED
        return _POP if f[2] in f[1] else _REJECT

    def _number(self, f: list, b: int) -> int:
        nxt = number_next(f[2], b, integer=f[1])
        if nxt is not None:
            f[2] = nxt
            return _CONSUMED
        return _POP if f[2] in NUMBER_ENDS else _REJECT

    def _string(self, f: list, b: int) -> int:
        """String body after the opening quote; the closing quote ends (pops) it."""
        ok = _string_byte(f, b)
        if ok == "close":
            self.stack.pop()
        return _CONSUMED if ok else _REJECT

    def _object(self, f: list, b: int) -> int:
        node, phase, seen, key = f[1], f[2], f[3], f[4]
        if phase == "keystr":
            return self._key_byte(f, b)
        if phase == "value_done":
            f[2] = "after"
        if b in _WS:
            return _CONSUMED if self._space(b) else _REJECT
        self.ws = 0
        phase = f[2]
        open_keys = [k for k in node["props"] if k not in seen]
        if b == 0x7D and phase in ("first", "after"):
            if not node["required"] <= seen:
                return _REJECT
            self.stack.pop()  # a container ends on its own closing byte
            return _CONSUMED
        if phase in ("first", "key") and b == 0x22:
            if not open_keys and node["extra"] is None:
                return _REJECT
            f[2], f[4] = "keystr", b""
            f.append([None, 0, 0x80, 0xBF, 0])  # string lexer state for keys outside the properties
            return _CONSUMED
        if phase == "after" and b == 0x2C:
            if not open_keys and node["extra"] is None:
                return _REJECT
            f[2] = "key"
            return _CONSUMED
        if phase == "colon" and b == 0x3A:
            prop = node["props"].get(key, node["extra"])
            f[2] = "value_done"
            self.stack.append(["value", prop])
            return _CONSUMED
        return _REJECT

    def _key_byte(self, f: list, b: int) -> int:
        node, seen, typed, lex = f[1], f[3], f[4], f[5]
        names = [k for k in node["props"] if k not in seen]
        if node["extra"] is None:  # only the schema's own names, each at most once
            if b == 0x22:
                if typed not in names:
                    return _REJECT
            elif not any(k.startswith(typed + bytes([b])) for k in names):
                return _REJECT
        else:
            r = _string_byte(lex, b)
            if not r:
                return _REJECT
            if r != "close":
                f[4] = typed + bytes([b])
                return _CONSUMED
            if typed in seen:
                return _REJECT  # a duplicate key
        if b == 0x22:
            f[2], f[3] = "colon", seen | {typed}
            del f[5]
            return _CONSUMED
        f[4] = typed + bytes([b])
        return _CONSUMED

    def _array(self, f: list, b: int) -> int:
        _, node, phase, count = f
        if b in _WS:
            return _CONSUMED if self._space(b) else _REJECT
        self.ws = 0
        if b == 0x5D and phase in ("first", "after"):
            if count < node["min"]:
                return _REJECT
            self.stack.pop()
            return _CONSUMED
        if phase == "after":
            if b != 0x2C or node["max"] is not None and count >= node["max"]:
                return _REJECT
            f[2] = "item"
            return _CONSUMED
        if node["max"] is not None and count >= node["max"]:
            return _REJECT
        f[2], f[3] = "after", count + 1
        self.stack.append(["value", node["items"]])
        return self._byte_into_top(b)

    def _byte_into_top(self, b: int) -> int:
        f = self.stack[-1]
        return getattr(self, "_" + f[0])(f, b)


def _string_byte(f: list, b: int) -> bool | str:
    """One byte of a JSON string body for lexer state f = [_, utf8 due, lo, hi, hex due]:
    True (taken), False (invalid), "close" (the closing quote)."""
    if f[1] > 0:  # UTF-8 continuation
        if not f[2] <= b <= f[3]:
            return False
        f[1], f[2], f[3] = f[1] - 1, 0x80, 0xBF
        return True
    if f[4] < 0:  # after a backslash
        if b not in _ESCAPES:
            return False
        f[4] = 4 if b == 0x75 else 0
        return True
    if f[4] > 0:  # \uXXXX
        if b not in _HEX:
            return False
        f[4] -= 1
        return True
    if b == 0x22:
        return "close"
    if b == 0x5C:
        f[4] = -1
        return True
    if b < 0x20:
        return False
    if b < 0x80:
        return True
    lead = utf8_lead(b)
    if lead is None:
        return False
    f[1], f[2], f[3] = lead
    return True


def object_state() -> SchemaState:
    """A recognizer of any JSON object text (OpenAI's JSON mode)."""
    return SchemaState(compile_schema({"type": "object"}))
