"""Responses API tools -> the functions the model is offered, and its calls -> the client's items.

Codex CLI (like the OpenAI API) declares more than `function` tools. A `namespace` tool groups
functions: they are offered flat as `NAMESPACE__NAME` (the flat spelling Codex itself uses when a
backend has no namespaces) and their calls come back as `function_call` items with `namespace`
and the inner `name`, which is how Codex routes them. A freeform `custom` tool (Codex's
`apply_patch`) takes raw text: it is offered as a function of one string, `input`, held to the
tool's grammar when that grammar is regular (server/lark_regex.py), and its calls come back as
`custom_tool_call` items carrying that string. Hosted tools (web_search, file_search, ...) run on
OpenAI's side: they are left out of the prompt and noted once in the log.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

import llguidance
from pydantic import Field

from hybridmoe.engine.constraints import ConstraintError, json_schema_spec
from hybridmoe.server.lark_regex import NotRegular, lark_to_regex
from hybridmoe.server.protocol import FunctionDef, Lenient, Tool, validate_tagged

log = logging.getLogger(__name__)

INPUT_KEY = "input"  # the one argument a freeform tool is offered with
NAMESPACE_SEPARATOR = "__"
MAX_GRAMMAR_IN_DESCRIPTION = 4000  # characters of a freeform tool's grammar shown to the model


class FunctionTool(Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class CustomFormat(Lenient):
    type: Literal["text", "grammar"] = "text"
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None


class CustomTool(Lenient):
    type: Literal["custom"]
    name: str = Field(min_length=1)
    description: str | None = None
    format: CustomFormat = Field(default_factory=CustomFormat)


class NamespaceTool(Lenient):
    type: Literal["namespace"]
    name: str = Field(min_length=1)
    description: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)


_INNER = {"function": FunctionTool, "custom": CustomTool}
_DECLARED = {**_INNER, "namespace": NamespaceTool}


@dataclass(frozen=True)
class Route:
    """Where a call to one offered function goes back to: its kind, name and namespace."""

    kind: Literal["function", "custom"]
    name: str
    namespace: str | None = None


DEFAULT_NAMESPACE = "functions"  # harmony's (and Codex's) namespace of plain functions


def wire_name(name: str, namespace: str | None) -> str:
    """The name the model sees (and writes) for a tool, flat."""
    if not namespace or namespace == DEFAULT_NAMESPACE:
        return name
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


@dataclass
class ToolMap:
    """One request's tools: what the model is offered (`offered`) and how its calls map back."""

    defs: dict[str, Tool] = field(default_factory=dict)  # what the model is offered, by wire name
    routes: dict[str, Route] = field(default_factory=dict)  # by wire name
    dropped: list[str] = field(default_factory=list)  # tool types left out (hosted)

    @property
    def offered(self) -> list[Tool]:
        return list(self.defs.values())

    @classmethod
    def parse(cls, tools: list[dict[str, Any]] | None, what: str = "tools") -> ToolMap:
        """ValueError naming the tool for a malformed function, custom or namespace tool; other
        types are dropped (a newer client's hosted tools must not fail the request). A tool
        declared again (Codex resends its `additional_tools` items) replaces the earlier one."""
        out = cls()
        out.add(tools, what)
        return out

    def add(self, tools: list[dict[str, Any]] | None, what: str) -> None:
        """Declare more tools (`what` names their list in errors)."""
        for i, raw in enumerate(tools or ()):
            kind = raw.get("type") if isinstance(raw, dict) else None
            if kind not in _DECLARED:
                if not isinstance(kind, str):
                    raise ValueError(f"{what}[{i}] must be an object with a 'type'")
                self.dropped.append(kind)
                continue
            tool = validate_tagged(raw, _DECLARED, f"{what}[{i}]")
            if isinstance(tool, NamespaceTool):
                for j, inner in enumerate(tool.tools):
                    if isinstance(inner, dict) and inner.get("type") not in _INNER:
                        self.dropped.append(f"{inner.get('type')} (in namespace {tool.name})")
                        continue
                    self._add(validate_tagged(inner, _INNER, f"{what}[{i}].tools[{j}]"), tool)
            else:
                self._add(tool, None)

    def _add(self, tool: FunctionTool | CustomTool, namespace: NamespaceTool | None) -> None:
        ns = namespace.name if namespace else None
        name = wire_name(tool.name, ns)
        description = tool.description
        if namespace is not None and namespace.description:
            description = f"{namespace.description}\n{description or ''}".rstrip()
        if isinstance(tool, CustomTool):
            description, parameters = _freeform(tool, description)
            self.routes[name] = Route("custom", tool.name, ns)
        else:
            parameters = tool.parameters
            self.routes[name] = Route("function", tool.name, ns)
        self.defs[name] = Tool(function=FunctionDef(name=name, description=description, parameters=parameters))

    def route(self, name: str) -> Route:
        """A call's route. A namespaced tool called by its bare name goes to it when no other
        tool has that name (as Codex resolves short names); an undeclared name stays a plain
        function call (the client answers it)."""
        found = self.routes.get(name)
        if found is None:
            matches = [r for r in self.routes.values() if r.name == name]
            found = matches[0] if len(matches) == 1 else Route("function", name)
        return found

    def note_dropped(self) -> None:
        """One log line the first time a kind of tool is left out (Codex sends them every turn)."""
        new = sorted(set(self.dropped) - _noted)
        if new:
            with _noted_lock:
                _noted.update(new)
            log.info("responses: tool types this server cannot run are left out of the prompt: %s", ", ".join(new))


_noted: set[str] = set()
_noted_lock = threading.Lock()


# ---- freeform (custom) tools ------------------------------------------------------------------
def _freeform(tool: CustomTool, description: str | None) -> tuple[str, dict[str, Any]]:
    """The description and parameters a freeform tool is offered with: one string, `input`."""
    fmt = tool.format
    note = f"Pass the tool's raw input as the string `{INPUT_KEY}`."
    if fmt.type == "grammar" and fmt.definition and len(fmt.definition) <= MAX_GRAMMAR_IN_DESCRIPTION:
        note += f" It follows this {fmt.syntax or 'lark'} grammar:\n{fmt.definition}"
    prop: dict[str, Any] = {"type": "string"}
    pattern = input_pattern(tool)
    if pattern is not None:
        prop["pattern"] = pattern
    params = {"type": "object", "properties": {INPUT_KEY: prop}, "required": [INPUT_KEY], "additionalProperties": False}
    return f"{description}\n\n{note}" if description else note, params


_patterns: dict[tuple[str | None, str], str | None] = {}  # (syntax, definition) -> regex; agents resend tools


def input_pattern(tool: CustomTool) -> str | None:
    """The regex a freeform tool's input is held to, None when its grammar has none this engine
    can enforce inside a JSON string (then the input is any string: the client checks it)."""
    fmt = tool.format
    if fmt.type != "grammar" or not fmt.definition:
        return None
    key = (fmt.syntax, fmt.definition)
    if key in _patterns:
        return _patterns[key]
    try:
        body = fmt.definition if fmt.syntax == "regex" else lark_to_regex(fmt.definition)
        pattern = f"^(?:{body})$"
        spec = json_schema_spec({"type": "string", "pattern": pattern}, "tools", lenient=True)
        error = llguidance.LLMatcher.validate_grammar(spec.grammar)
        if error:
            raise NotRegular(error)
    except (NotRegular, ConstraintError, RecursionError) as e:
        log.info("responses: the input of tool '%s' is not held to its grammar (%s)", tool.name, e)
        pattern = None
    if len(_patterns) >= 64:
        _patterns.pop(next(iter(_patterns)))
    _patterns[key] = pattern
    return pattern


def freeform_input(arguments: str) -> str:
    """The raw input of a freeform call: the `input` string of its JSON arguments, or the
    arguments as written when they are not that object (a model that ignored the wrapper)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(INPUT_KEY), str):
        return value[INPUT_KEY]
    return arguments


def freeform_arguments(text: str) -> str:
    """A freeform call's input as the arguments the model wrote for it (history)."""
    return json.dumps({INPUT_KEY: text}, ensure_ascii=False)
