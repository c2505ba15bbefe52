"""JSON schemas whose `$ref` loops read no input (engine/schema_refs.py): refused when the spec is
built, naming the `$ref`, instead of compiling and failing at the first mask in sampling; recursive
schemas that read input between the levels keep working. Also a grammar that allows nothing at its
start (GBNF `root ::= root`), refused at compile instead of at the first mask."""

from __future__ import annotations

import llguidance
import pytest

from hybridmoe.engine import constraints as C
from hybridmoe.engine.constraints import ConstraintError, gbnf_spec, json_schema_spec
from hybridmoe.engine.schema_refs import find_ref_loop
from tests.constraint_helpers import VOCAB, constraint, feeds

LOOP = {"$ref": "#/$defs/l"}  # with DEFS: a def that is only itself
DEFS = {"l": {"$ref": "#/$defs/l"}}

LOOPS = [  # (schema, the $ref the error names, relative to the field)
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, ".$defs.a.$ref"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}, ".$defs.a.$ref"),
    ({"$ref": "#"}, ".$ref"),
    ({"definitions": {"a": {"allOf": [{"$ref": "#/definitions/a"}]}}, "$ref": "#/definitions/a"},
     ".definitions.a.allOf[0].$ref"),
    ({"anyOf": [{"$ref": "#"}, {"$ref": "#"}]}, ".anyOf[0].$ref"),  # every alternative loops
    # Reached only after some output: a 500 mid-reply before, as soon as the model wrote `{"x":`.
    ({"type": "object", "properties": {"x": LOOP}, "$defs": DEFS}, ".$defs.l.$ref"),
    ({"type": "array", "items": LOOP, "$defs": DEFS}, ".$defs.l.$ref"),
    ({"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}}, ".properties.a.$ref"),
    # The ways a $ref can point: escaped and percent-encoded pointers, an $anchor, the root's $id.
    ({"$defs": {"a/b c": {"$ref": "#/$defs/a~1b%20c"}}, "$ref": "#/$defs/a~1b c"}, ".$defs.a/b c.$ref"),
    ({"$defs": {"a": {"$anchor": "me", "$ref": "#me"}}, "$ref": "#me"}, ".$defs.a.$ref"),
    ({"$id": "https://example.com/s", "$defs": {"a": {"$ref": "https://example.com/s#/$defs/a"}},
      "$ref": "#/$defs/a"}, ".$defs.a.$ref"),
]


@pytest.mark.parametrize("schema,ref_at", LOOPS)
def test_ref_loops_are_refused_naming_the_ref(schema, ref_at):
    with pytest.raises(ConstraintError) as e:
        json_schema_spec(schema, "response_format.json_schema.schema")
    assert e.value.param == "response_format.json_schema.schema" + ref_at
    assert str(e.value).startswith(e.value.param + ": a $ref loop"), e.value


def test_a_looping_tool_schema_is_refused_even_when_lenient():
    """Tool parameters are compiled leniently (unknown keywords ignored), but a loop is no keyword."""
    with pytest.raises(ConstraintError, match=r"\$ref loop") as e:
        json_schema_spec({"type": "object", "properties": {"x": LOOP}, "$defs": DEFS}, "tools[0].function.parameters",
                         lenient=True)
    assert e.value.param == "tools[0].function.parameters.$defs.l.$ref"


def test_what_the_loop_check_refuses_llguidance_cannot_sample():
    """The reason for the check: compiled as is, the first mask fails (no token allowed)."""
    table = C.token_table(VOCAB)
    for schema, _ in LOOPS[:3]:
        matcher = llguidance.LLMatcher(table.ll, llguidance.LLMatcher.grammar_from_json_schema(schema), log_level=0)
        assert not matcher.is_error()  # llguidance accepts it at compile ...
        c = C.GrammarConstraint(matcher, table, frozenset({VOCAB.end}))
        with pytest.raises(ValueError, match="constraint failed"):
            c.mask()  # ... and fails at the first mask


TREE = {"type": "object", "properties": {"child": {"$ref": "#"}, "v": {"type": "integer"}}}


@pytest.mark.parametrize("schema,texts", [
    (TREE, ['{"child":{"child":{}},"v":1}', "{}"]),  # keys in the schema's order
    ({"$defs": {"l": {"type": "array", "items": {"$ref": "#/$defs/l"}}}, "$ref": "#/$defs/l"}, ["[[],[[]]]"]),
    ({"$defs": {"json": {"anyOf": [{"type": "object", "additionalProperties": {"$ref": "#/$defs/json"}},
                                   {"type": "array", "items": {"$ref": "#/$defs/json"}}, {"type": "string"},
                                   {"type": "number"}]}}, "$ref": "#/$defs/json"}, ['{"a":[1,"x",{}]}', "2"]),
    # A loop with a way out matches what the way out does (llguidance samples it fine).
    ({"anyOf": [{"$ref": "#"}, {"type": "null"}]}, ["null"]),
    ({"$defs": {"base": {"type": "object", "properties": {"id": {"type": "integer"}}},
                "kid": {"allOf": [{"$ref": "#/$defs/base"}]}}, "$ref": "#/$defs/kid"}, ['{"id":3}']),
    ({"type": "object", "$defs": DEFS}, ["{}"]),  # a looping def nobody uses
])
def test_recursion_that_reads_input_keeps_working(schema, texts):
    spec = json_schema_spec(schema, "s")
    assert find_ref_loop(C.check_schema(schema, "s")) is None
    constraint(spec).mask()  # the first mask is served
    for text in texts:
        assert feeds(spec, text.encode()), text


def test_gbnf_that_allows_nothing_is_refused_at_compile():
    table = C.token_table(VOCAB)
    for text in ("root ::= root", "root ::= a\na ::= root"):
        with pytest.raises(ConstraintError, match="no text can start it") as e:
            C.compile_constraint(gbnf_spec(text), table)
        assert e.value.param == "grammar"
    assert feeds(gbnf_spec('root ::= "x" | root'), b"x")  # a way out: served
