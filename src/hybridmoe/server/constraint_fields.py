"""The request fields that constrain the output, as one engine constraint: llama-server's `grammar`
(GBNF) and `json_schema`, OpenAI's `response_format` (json_object, json_schema, and llama-server's
{"type": "json_object", "schema": {...}}), and a named tool_choice (the call's arguments follow the
function's `parameters`). Errors are `ConstraintError`s naming the field."""

from __future__ import annotations

from hybridmoe.engine.constraints import ConstraintError, ConstraintSpec, gbnf_spec, json_object_spec, json_schema_spec
from hybridmoe.server.protocol import SamplingFields, Tool


def tool_arguments_spec(tools: list[Tool], i: int, call_end_ids: tuple[int, ...] | None) -> ConstraintSpec:
    """What the arguments of a call to `tools[i]` must match: its `parameters` schema (any JSON
    object without one), ending with `call_end_ids`."""
    params = tools[i].function.parameters
    if not params:
        return json_object_spec(end_ids=call_end_ids)
    # Lenient: keywords the engine cannot enforce are ignored; a malformed shape is still a 400.
    return json_schema_spec(params, f"tools[{i}].function.parameters", lenient=True, end_ids=call_end_ids)


def output_constraint(fields: SamplingFields, tools: list[Tool] | None = None, forced: str | None = None,
                      call_end_ids: tuple[int, ...] | None = None) -> ConstraintSpec | None:
    """The spec for what the output must match, or None. `forced`: a function the reply must call
    (its arguments end with `call_end_ids`, not with the stop ids)."""
    if forced:
        i = next(i for i, t in enumerate(tools or []) if t.function.name == forced)
        return tool_arguments_spec(tools or [], i, call_end_ids)
    if fields.grammar is not None:
        return gbnf_spec(fields.grammar, "grammar")
    if fields.json_schema is not None:
        return json_schema_spec(fields.json_schema, "json_schema")
    rf = fields.response_format or {}
    if rf.get("type") == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise ConstraintError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                                  "response_format.json_schema")
        return json_schema_spec(js["schema"], "response_format.json_schema.schema")
    if rf.get("type") == "json_object":
        if "schema" in rf:
            return json_schema_spec(rf["schema"], "response_format.schema")
        return json_object_spec()
    return None
