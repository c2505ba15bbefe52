"""Catch-all over the published schema: no request-shaped input gets a 5xx, and the server keeps
serving. Bodies are built by hypothesis from /openapi.json, every field also drawing hostile
values (lone surrogates, 2**64 and beyond, NaN/Infinity, deep nesting, reserved template keys).

HM_FUZZ_EXAMPLES sets the number of requests (default 150, CI-sized); HM_FUZZ_RANDOM=1 draws a
new random sequence instead of the fixed one CI replays.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="the fuzz test needs hypothesis (pip install -e '.[test]')")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from .conftest import ServerProcess  # noqa: E402

N_EXAMPLES = int(os.environ.get("HM_FUZZ_EXAMPLES", "150"))
GENERATION_CAP = 4  # tokens: the fuzz is about request handling, not generation

_DEEP = {"a": None}
for _ in range(299):
    _DEEP = {"type": "object", "properties": {"x": _DEEP}}

HOSTILE = st.sampled_from([
    "a\ud800b", "\udfff", "\ud83d\ude00", "", "\x00", "<|start|>assistant<|message|>", "{{ 7*7 }}",
    2**63, 2**64, -(2**63) - 1, 10**40, -1, 0, 1e400, -1e400, float("nan"), 1.5, True,
    [], {}, [[[[[[[[[[]]]]]]]]]], _DEEP,
    {"tools": 1}, {"messages": []}, {"add_generation_prompt": False}, {"template": "x"},
])


def json_values() -> st.SearchStrategy[Any]:
    scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12) | HOSTILE
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


def from_schema(schema: dict[str, Any], spec: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
    """Values of a JSON schema (the subset FastAPI publishes), each node sometimes hostile."""
    if depth > 6:
        return json_values()
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return from_schema(spec["components"]["schemas"][name], spec, depth)
    typed: st.SearchStrategy[Any]
    if "anyOf" in schema or "oneOf" in schema:
        typed = st.one_of([from_schema(s, spec, depth + 1) for s in schema.get("anyOf", schema.get("oneOf"))])
    elif "enum" in schema:
        typed = st.sampled_from(schema["enum"])
    elif "const" in schema:
        typed = st.just(schema["const"])
    else:
        kind = schema.get("type")
        if kind == "string":
            typed = st.text(max_size=24)
        elif kind == "integer":
            typed = st.integers(min_value=-5, max_value=40) | st.integers()
        elif kind == "number":
            typed = st.floats(min_value=-1, max_value=3) | st.floats()
        elif kind == "boolean":
            typed = st.booleans()
        elif kind == "null":
            typed = st.none()
        elif kind == "array":
            typed = st.lists(from_schema(schema.get("items", {}), spec, depth + 1), max_size=3)
        elif kind == "object" and "properties" in schema:
            props = {k: from_schema(v, spec, depth + 1) for k, v in schema["properties"].items()}
            required = [k for k in schema.get("required", []) if k in props]
            typed = st.fixed_dictionaries({k: props[k] for k in required},
                                          optional={k: v for k, v in props.items() if k not in required})
        else:
            typed = json_values()
    return st.one_of(typed, typed, typed, json_values())


def _cap_generation(body: Any) -> Any:
    """Valid requests would otherwise generate up to a whole context on the tiny model."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            v = body.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > GENERATION_CAP:
                body[key] = GENERATION_CAP
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = GENERATION_CAP
    return body


def _operations(spec: dict[str, Any]) -> list[tuple[str, str, dict[str, Any] | None]]:
    ops = []
    for path, methods in sorted(spec["paths"].items()):
        for method, op in sorted(methods.items()):
            schema = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            ops.append((method.upper(), path, schema))
    return ops


def _request_strategy(spec: dict[str, Any]) -> st.SearchStrategy[tuple[str, str, bytes | None]]:
    def body_for(op: tuple[str, str, dict[str, Any] | None]) -> st.SearchStrategy[tuple[str, str, bytes | None]]:
        method, path, schema = op
        if schema is None:
            return st.just((method, path, None)) | st.sampled_from([("HEAD", path, None)])
        raw = st.one_of(
            from_schema(schema, spec).map(_cap_generation).map(lambda b: json.dumps(b).encode()),
            st.binary(max_size=40),  # not JSON at all
            st.sampled_from([b"", b"{", b"[1]", b"null", b'{"messages": [' * 2000, b'"\\ud800"']),
        )
        return raw.map(lambda body: (method, path, body))

    return st.sampled_from(_operations(spec)).flatmap(body_for)


def test_no_request_gets_a_5xx(server: ServerProcess):
    status, spec = server.request("GET", "/openapi.json")
    assert status == 200 and isinstance(spec, dict) and spec["paths"], spec
    failures: list[str] = []

    @settings(max_examples=N_EXAMPLES, deadline=None, database=None,
              derandomize=os.environ.get("HM_FUZZ_RANDOM") != "1",
              suppress_health_check=list(HealthCheck))
    @given(_request_strategy(spec))
    def one(request: tuple[str, str, bytes | None]) -> None:
        method, path, body = request
        status, answer = server.request(method, path, body)
        text = answer if isinstance(answer, str) else json.dumps(answer)
        if status >= 500 or "server_error" in text:
            failures.append(f"{method} {path} {body[:300] if body else body!r} -> {status} {text[:300]}")
        assert server.proc.poll() is None, f"server died on {method} {path} {body[:300] if body else body!r}"
        assert server.request("GET", "/health")[0] == 200

    one()
    assert not failures, "\n".join(failures[:20])
    status, answer = server.request("POST", "/v1/chat/completions",
                                    {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3})
    assert status == 200 and answer["choices"][0]["finish_reason"] in ("stop", "length")
