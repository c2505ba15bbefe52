"""Constrained decoding: GBNF grammars and JSON schemas, one engine (llguidance).

A request's constraint goes through three steps:
1. `json_schema_spec` / `json_object_spec` / `gbnf_spec` check what the client sent (shapes and the
   size limits below; `ConstraintError` names the field) and turn it into llguidance's grammar text:
   cheap, pure Python, on the request's own task.
2. `compile_constraint` builds the matcher (lexer, parser tables) for the tokenizer's token table:
   the expensive part, done once per request off the engine thread (llguidance drops the GIL).
3. `make_constraint` hands the engine a `GrammarConstraint`: a per-token bitmask of the allowed
   tokens (Rust; bounded by llguidance's per-step fuel, not by the schema's size) and `advance`.

End of generation: the request's end ids (stop / end-of-generation tokens) are allowed exactly
when the grammar accepts the text so far; once the grammar can go no further they are the only
choice. Special tokens never match grammar text (llguidance sees them behind a 0xFF byte).
"""

from __future__ import annotations

import json
import math
import re
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import llguidance
import numpy as np
import torch

from hybridmoe.engine.schema_refs import find_ref_loop

# Limits on what one request may ask for, far above real structured-output schemas (OpenAI's own
# limits are 5,000 properties, 1,000 enum values and 10 levels): they bound the matcher's build
# time (~0.5 s at the limits on one core) and, for properties, the per-token mask cost.
MAX_SCHEMA_DEPTH = 32  # nesting of subschemas
MAX_SCHEMA_PROPERTIES = 1_000  # all `properties` entries of all objects together
MAX_OBJECT_PROPERTIES = 400  # in one object: its optional keys are alternatives at every key position,
# and llguidance's parser refuses a row of more than 2,000 items (~4 per optional key)
MAX_SCHEMA_ENUM_VALUES = 10_000  # all `enum` values (and `const`s) together
MAX_SCHEMA_NODES = 10_000  # subschemas in all
MAX_GRAMMAR_BYTES = 128 * 1024  # GBNF text (llama.cpp's sample grammars are 1-3 KB)
# Whitespace between JSON tokens, as llama.cpp's converter allows it (`space ::= | " " | "\n"
# [ \t]{0,20}`): one space, or a newline and up to 20 of indentation; a weak model then cannot
# spend its budget on blank lines, and pretty-printed JSON stays possible.
JSON_WHITESPACE = r"(?: |\n[ \t]{0,20})?"

_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_VALUES = ("additionalProperties", "additionalItems", "unevaluatedProperties", "unevaluatedItems",
                  "not", "contains", "propertyNames", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_COUNTS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties",
           "minContains", "maxContains")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_STRINGS = ("pattern", "format", "$ref")
_MAX_COUNT = 2**31 - 1


class ConstraintError(ValueError):
    """A grammar or schema the engine refuses (malformed, too big, unsupported): the server
    answers 400 with `param` naming the request field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ConstraintSpec:
    """What a request's output must match. `grammar` is llguidance's grammar text (build it with
    the *_spec functions); `end_ids`: the tokens that may end it (None: the request's stop ids);
    `matcher`: set by `compile_constraint`, so the engine thread never builds one."""

    grammar: str
    end_ids: tuple[int, ...] | None = None
    param: str | None = None  # the request field it came from, for error messages
    matcher: Any = field(default=None, compare=False, repr=False)


# ---------------------------------------------------------------------------------- token table
class TokenTable:
    """The tokenizer's vocabulary as llguidance sees it (token bytes, specials marked), built once
    per tokenizer (~1-3 s for 128k-201k tokens): see `token_table`."""

    def __init__(self, tokenizer: Any) -> None:
        n = tokenizer.vocab_size
        special = tokenizer.special_ids
        eog = sorted(tokenizer.eog_ids) or [tokenizer.eos_id if tokenizer.eos_id is not None else 0]
        tokens = [b"\xff" + tokenizer.token_bytes(i) if i in special else tokenizer.token_bytes(i) for i in range(n)]
        self.n_vocab = n
        self.eos_ids = tuple(eog)  # llguidance allows these when the grammar accepts; we swap in the request's

        class _Source:  # the shape llguidance.TokenizerWrapper reads
            eos_token_id = eog[0]
            bos_token_id = tokenizer.bos_id
            special_token_ids = sorted(special)

            def __init__(self) -> None:
                self.tokens = tokens

            def __call__(self, text: str) -> list[int]:
                if not isinstance(text, str):
                    raise TypeError("text only")  # llguidance then passes str
                return tokenizer.encode(text, allow_special=False)

        self.ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Source()), n_vocab=n, eos_token=eog)


_tables: weakref.WeakKeyDictionary[Any, TokenTable] = weakref.WeakKeyDictionary()
_tables_lock = threading.Lock()


def token_table(tokenizer: Any) -> TokenTable:
    """The tokenizer's TokenTable, built on first use and kept while the tokenizer lives."""
    with _tables_lock:
        table = _tables.get(tokenizer)
        if table is None:
            table = _tables[tokenizer] = TokenTable(tokenizer)
        return table


# ------------------------------------------------------------------------------------ specs
def json_object_spec(end_ids: tuple[int, ...] | None = None) -> ConstraintSpec:
    """Any JSON object (OpenAI's JSON mode)."""
    return json_schema_spec({"type": "object"}, "response_format", end_ids=end_ids)


def json_schema_spec(schema: Any, param: str, *, lenient: bool = False,
                     end_ids: tuple[int, ...] | None = None) -> ConstraintSpec:
    """A JSON schema checked (shapes, limits) and turned into a grammar. `lenient`: keywords the
    engine cannot enforce are ignored instead of refused (tool parameters: any schema a client
    declares should still give a call)."""
    checked = check_schema(schema, param)
    options: dict[str, Any] = {"whitespace_pattern": JSON_WHITESPACE, "lenient": lenient,
                               "json_allow_general_unicode_escapes": True}
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(checked, overrides=options)
    except (ValueError, TypeError, RecursionError) as e:
        raise ConstraintError(f"{param}: {_short(str(e))}", param) from None
    return ConstraintSpec(grammar, end_ids, param)


def gbnf_spec(text: Any, param: str = "grammar", end_ids: tuple[int, ...] | None = None) -> ConstraintSpec:
    """A GBNF grammar (llama.cpp's grammars/README.md; `root` is the start rule)."""
    if not isinstance(text, str):
        raise ConstraintError(f"{param} must be a string of GBNF rules, got {type(text).__name__}", param)
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_GRAMMAR_BYTES:
        raise ConstraintError(f"{param} is {size} bytes; at most {MAX_GRAMMAR_BYTES} are accepted", param)
    if not text.strip():
        raise ConstraintError(f"{param} is empty", param)
    try:
        grammar = llguidance.grammar_from("gbnf", text)
    except Exception as e:  # the converter raises its own error types on bad input
        raise ConstraintError(f"{param}: {e}", param) from None
    return ConstraintSpec(grammar, end_ids, param)


def compile_constraint(spec: ConstraintSpec, table: TokenTable) -> ConstraintSpec:
    """The spec with its matcher built; ConstraintError if llguidance refuses the grammar (an
    unsupported keyword, a grammar over its size limits, a GBNF rule it cannot parse) or if it
    allows nothing at all at its start (GBNF `root ::= root`): the first mask is computed here, on
    a copy, so that such a grammar is the request's error and not the engine's mid-generation."""
    matcher = llguidance.LLMatcher(table.ll, spec.grammar, log_level=0)
    if matcher.is_error():
        raise ConstraintError(f"{spec.param or 'grammar'}: {_short(matcher.get_error())}", spec.param)
    first = matcher.deep_copy()
    bits = np.zeros((table.n_vocab + 31) // 32, dtype=np.int32)
    first.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
    if first.is_error():
        raise ConstraintError(f"{spec.param or 'grammar'}: no text can start it (a rule that only refers to "
                              "itself, like `root ::= root`?)", spec.param)
    return replace(spec, matcher=matcher)


def make_constraint(spec: ConstraintSpec | None, table: TokenTable,
                    stop_ids: frozenset[int]) -> GrammarConstraint | None:
    """The engine's one entry point: a fresh constraint for one generation (None without a spec).
    ValueError when the grammar is refused (only if the spec was not compiled beforehand)."""
    if spec is None:
        return None
    matcher = (spec.matcher if spec.matcher is not None else compile_constraint(spec, table).matcher).deep_copy()
    ends = frozenset(stop_ids if spec.end_ids is None else spec.end_ids)
    return GrammarConstraint(matcher, table, ends)


def _short(message: str, limit: int = 300) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[:limit] + "..."


# ---------------------------------------------------------------------------------- the sampler side
class GrammarConstraint:
    """Per-request state for the sampler: `mask()` (bool per token id) before each draw,
    `advance(token)` after it; `done` once the text is complete."""

    def __init__(self, matcher: Any, table: TokenTable, end_ids: frozenset[int]) -> None:
        self._m = matcher
        self._table = table
        self.end_ids = end_ids
        self._bits = np.full((table.n_vocab + 31) // 32, -1, dtype=np.int32)
        self._llg_eos = torch.tensor(table.eos_ids, dtype=torch.int64)
        self._ends = torch.tensor(sorted(i for i in end_ids if 0 <= i < table.n_vocab), dtype=torch.int64)

    @property
    def done(self) -> bool:
        return self._m.is_accepting()

    def mask(self) -> torch.Tensor:
        """Bool [n_vocab]: the tokens that may come next (the end ids exactly when the text so far
        is complete). Raises ValueError if the matcher failed (it then allows nothing)."""
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self._m.is_error():
            raise ValueError(f"constraint failed: {_short(self._m.get_error())}")
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self._table.n_vocab]
        allowed = torch.from_numpy(bits.astype(bool))
        allowed[self._llg_eos] = False
        if self._m.is_accepting():
            allowed[self._ends] = True
        return allowed

    def advance(self, token: int) -> None:
        if token in self.end_ids and self._m.is_accepting():
            return
        if not self._m.consume_token(token):
            raise ValueError(f"token {token} does not continue the constrained text: {_short(self._m.get_error())}")


@dataclass(frozen=True)
class ToolCallSpecs:
    """tool_choice "auto" / "required" on a harmony (gpt-oss) model: each function's compiled arguments spec
    (ending with the call-end token), applied only once the model writes a call to it, as llama-server's
    lazy tool-call grammar does; then the ids of the chat format's message-start, message-end,
    header-end, call-end and return tokens; `header`: header text the prompt already wrote for the
    first message (tool_choice "required" forces the commentary channel's `to=functions`); `names`:
    with that header, what must follow it up to the header-end token (`tool_names_spec`: a declared
    name), as llama-server's grammar for a required call restricts the name too."""

    specs: Mapping[str, ConstraintSpec]
    start: int
    end: int
    message: int
    call: int
    ret: int
    header: bytes = b""
    names: ConstraintSpec | None = None


def tool_names_spec(names: list[str], end_ids: tuple[int, ...]) -> ConstraintSpec:
    """`.NAME` for one of `names`, then harmony's content type (` <|constrain|>json`; a bare
    ` json` or space too): what a required call's header holds between `to=functions` and the
    header-end token (end_ids)."""
    quoted = " | ".join(json.dumps(n, ensure_ascii=False) for n in dict.fromkeys(names))
    text = f'start: "." ({quoted}) tail?\ntail: " " | " json" | " "? <|constrain|> "json"'
    try:
        grammar = llguidance.grammar_from("lark", text)
    except Exception as e:  # the converter raises its own error types
        raise ConstraintError(f"tools: a function name the engine cannot match ({_short(str(e))})", "tools") from None
    return ConstraintSpec(grammar, end_ids, "tools")


class LazyToolCalls:
    """Free text until a message header (since the message-start token) names `to=functions.NAME`
    and reaches the header-end token; then NAME's arguments constraint until the call-end token.
    Calls to names not in `specs` stay free (the client sees what the model wrote), except the first
    call of a required one, whose name `tools.names` holds to the declared ones."""

    _RECIPIENT = re.compile(rb"to=functions\.([^\s<]+)")
    _MAX_HEADER = 512  # bytes of header text kept (a recipient comes in the first few tokens)

    def __init__(self, tools: ToolCallSpecs, table: TokenTable, token_bytes: Callable[[int], bytes]) -> None:
        self._tools = tools
        self._table = table
        self._bytes = token_bytes
        self._header = bytearray(tools.header)
        self._active: GrammarConstraint | None = None
        self._resets = frozenset({tools.start, tools.end, tools.call, tools.ret})
        self._naming = make_constraint(tools.names, table, frozenset()) if tools.names is not None else None

    done = False  # generation ends by the request's own stop tokens

    def mask(self) -> torch.Tensor | None:
        """The name or arguments constraint's mask inside a known call, else None (no constraint)."""
        if self._naming is not None:
            return self._naming.mask()
        return self._active.mask() if self._active is not None else None

    def advance(self, token: int) -> None:
        t = self._tools
        if self._naming is not None:  # the header goes on below: its recipient picks the arguments' spec
            self._naming.advance(token)
            if token == t.message:
                self._naming = None
        if self._active is not None:
            self._active.advance(token)
            if token == t.call:
                self._active = None
            return
        if token in self._resets:
            self._header.clear()
        elif token == t.message:
            found = self._RECIPIENT.search(bytes(self._header))
            self._header.clear()
            spec = t.specs.get(found.group(1).decode("utf-8", "replace")) if found else None
            if spec is not None:
                self._active = make_constraint(spec, self._table, frozenset((t.call,)))
        elif len(self._header) < self._MAX_HEADER:
            self._header += self._bytes(token)


# ---------------------------------------------------------------------------------- schema checks
def check_schema(schema: Any, param: str) -> dict | bool:
    """A copy of the schema with shapes checked (ConstraintError naming the field for what JSON
    Schema forbids, e.g. `"required": [["a"]]`, `"maxItems": 1e400`), the limits above enforced,
    and two normalizations: tuple-form `items` becomes `prefixItems`, and an object with
    `properties` but no `additionalProperties` admits no other keys (as llama.cpp's converter).
    A `$ref` loop that reads no input is refused too (`schema_refs.find_ref_loop`)."""
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(f"{param} must be a JSON object (a schema), got {_kind(schema)}", param)
    counts = {"nodes": 0, "properties": 0, "enum": 0}
    checked = _check(schema, param, 0, counts)
    loop = find_ref_loop(checked)
    if loop is not None:  # llguidance would compile it and fail at the first mask that reaches it
        where = f"{param}{loop.ref_at}.$ref"
        around = " -> ".join(p.lstrip(".") or "the schema" for p in loop.path)
        raise ConstraintError(f"{where}: a $ref loop that reads no input and has no way out ({around}); "
                              "no JSON value matches it", where)
    return checked


def _kind(v: Any) -> str:
    return "null" if v is None else {bool: "a boolean", int: "a number", float: "a number", str: "a string",
                                     list: "an array", dict: "an object"}.get(type(v), type(v).__name__)


def _check(s: Any, where: str, depth: int, counts: dict[str, int]) -> dict | bool:
    if isinstance(s, bool):
        return s
    if not isinstance(s, dict):
        raise ConstraintError(f"{where} must be a schema (an object or a boolean), got {_kind(s)}", where)
    if depth > MAX_SCHEMA_DEPTH:
        raise ConstraintError(f"{where}: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels", where)
    counts["nodes"] += 1
    if counts["nodes"] > MAX_SCHEMA_NODES:
        raise ConstraintError(f"{where}: the schema has more than {MAX_SCHEMA_NODES} subschemas", where)
    out = dict(s)
    for key in _SCHEMA_MAPS:
        if key in s:
            m = s[key]
            if not isinstance(m, dict):
                raise ConstraintError(f"{where}.{key} must be an object mapping names to schemas, got {_kind(m)}",
                                      f"{where}.{key}")
            if key == "properties":
                if len(m) > MAX_OBJECT_PROPERTIES:
                    raise ConstraintError(f"{where}.{key}: an object has {len(m)} properties; at most "
                                          f"{MAX_OBJECT_PROPERTIES} per object are accepted", f"{where}.{key}")
                counts["properties"] += len(m)
                if counts["properties"] > MAX_SCHEMA_PROPERTIES:
                    raise ConstraintError(f"{where}.{key}: the schema has more than {MAX_SCHEMA_PROPERTIES} "
                                          "properties in all", f"{where}.{key}")
            out[key] = {k: _check(v, f"{where}.{key}.{k}", depth + 1, counts) for k, v in m.items()}
    for key in _SCHEMA_VALUES:
        if key in s:
            out[key] = _check(s[key], f"{where}.{key}", depth + 1, counts)
    for key in _SCHEMA_LISTS:
        if key in s:
            v = s[key]
            if not isinstance(v, list) or (not v and key != "prefixItems"):
                raise ConstraintError(f"{where}.{key} must be a non-empty array of schemas, got {_kind(v)}",
                                      f"{where}.{key}")
            out[key] = [_check(x, f"{where}.{key}[{i}]", depth + 1, counts) for i, x in enumerate(v)]
    if "items" in s:
        items = s["items"]
        if isinstance(items, list):  # draft-07 tuple form: the 2020-12 spelling the compiler knows
            if "prefixItems" in s:
                raise ConstraintError(f"{where}: tuple-form items and prefixItems together", f"{where}.items")
            out["prefixItems"] = [_check(x, f"{where}.items[{i}]", depth + 1, counts) for i, x in enumerate(items)]
            extra = out.pop("additionalItems", True)  # checked above
            if extra is True:
                out.pop("items")
            else:
                out["items"] = extra
        else:
            out["items"] = _check(items, f"{where}.items", depth + 1, counts)
    for key in _COUNTS:
        if key in s:
            out[key] = _count(s[key], f"{where}.{key}")
    for key in _NUMBERS:
        if key in s:
            v = s[key]
            if isinstance(v, bool) and key.startswith("exclusive"):
                continue  # draft-04 spelling: a flag on minimum / maximum
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConstraintError(f"{where}.{key} must be a finite number, got {_kind(v)}", f"{where}.{key}")
            if key == "multipleOf" and v <= 0:
                raise ConstraintError(f"{where}.{key} must be greater than 0", f"{where}.{key}")
    for key in _STRINGS:
        if key in s and not isinstance(s[key], str):
            raise ConstraintError(f"{where}.{key} must be a string, got {_kind(s[key])}", f"{where}.{key}")
    if "required" in s:
        req = s["required"]
        if not isinstance(req, list) or not all(isinstance(r, str) for r in req):
            raise ConstraintError(f"{where}.required must be an array of property names (strings)",
                                  f"{where}.required")
    if "type" in s:
        t = s["type"]
        names = t if isinstance(t, list) else [t]
        if not names or not all(isinstance(x, str) and x in _TYPES for x in names):
            raise ConstraintError(f"{where}.type must be one of {sorted(_TYPES)} or a non-empty array of them, "
                                  f"got {json.dumps(t)[:80]}", f"{where}.type")
    if "enum" in s:
        if not isinstance(s["enum"], list) or not s["enum"]:
            raise ConstraintError(f"{where}.enum must be a non-empty array, got {_kind(s['enum'])}", f"{where}.enum")
        counts["enum"] += len(s["enum"])
    if "const" in s:
        counts["enum"] += 1
    if counts["enum"] > MAX_SCHEMA_ENUM_VALUES:
        raise ConstraintError(f"{where}: the schema has more than {MAX_SCHEMA_ENUM_VALUES} enum values in all",
                              f"{where}.enum")
    if "properties" in s and "additionalProperties" not in s:
        out["additionalProperties"] = False
    return out


def _count(v: Any, where: str) -> int:
    """A JSON Schema non-negative integer (2.0 counts as 2)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConstraintError(f"{where} must be a non-negative integer, got {_kind(v)}", where)
    if isinstance(v, float) and not (math.isfinite(v) and v.is_integer()):
        raise ConstraintError(f"{where} must be a non-negative integer, got {v!r}", where)
    if not 0 <= v <= _MAX_COUNT:
        raise ConstraintError(f"{where} must be between 0 and {_MAX_COUNT}, got {v!r}", where)
    return int(v)
