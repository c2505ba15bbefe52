"""JSON schema `$ref` loops that read no input, found before llguidance compiles the schema.

`{"$ref": "#"}`, or a → b → a through `$ref` / allOf / anyOf / oneOf alone, defines a value by
itself and matches nothing: llguidance compiles it, then has no token to allow at the first mask
that reaches it, so the request would fail mid-way. Recursion through properties or items (a
tree) reads at least a bracket between the levels, and an anyOf with a way out of the loop
(`{"anyOf": [{"$ref": "#"}, {"type": "null"}]}`) still matches something: both stay valid.
Pure Python over the checked schema (constraints.check_schema), linear in its size.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

# Subschemas that describe the same JSON value as their parent (nothing is read in between).
SAME_VALUE = ("allOf", "anyOf", "oneOf")
# Subschemas that describe a part of it (a member, a key, an item: a bracket is read first).
PART_MAPS = ("properties", "patternProperties")
PART_VALUES = ("additionalProperties", "additionalItems", "unevaluatedProperties", "unevaluatedItems",
               "contains", "propertyNames", "items")
# `not`, `if`/`then`/`else` and `dependentSchemas` are left out: llguidance builds no rule from
# them (it refuses them, or ignores them when lenient), so a loop through them is harmless.
DEFS = ("$defs", "definitions")  # applied only through a $ref

Edge = tuple[str, Any, str]  # (keyword that leads there, subschema, its path)


@dataclass(frozen=True)
class RefLoop:
    """A loop, as paths relative to the root ("" is the root, ".$defs.a" one of its defs):
    `ref_at` holds the `$ref` that closes it; `path` goes around it, its first entry again last."""

    ref_at: str
    path: tuple[str, ...]


def find_ref_loop(root: Any) -> RefLoop | None:
    """A loop among the subschemas `root` uses (unused $defs do not count) that nothing but the
    loop itself can satisfy, or None. Refs to other documents or under nested `$id`s are left to
    the compiler."""
    if not isinstance(root, dict):
        return None
    anchors = {s["$anchor"]: (s, p) for s, p in _every_subschema(root) if isinstance(s.get("$anchor"), str)}

    def needs(node: dict, where: str) -> list[list[Edge]]:
        """What `node`'s own value must also match: one list of alternatives per requirement
        (each allOf member and the $ref alone, an anyOf's or oneOf's members together)."""
        groups = [[e] for e in _members(node, where, "allOf")]
        groups += [g for g in (_members(node, where, "anyOf"), _members(node, where, "oneOf")) if g]
        target = _resolve(root, anchors, node["$ref"]) if isinstance(node.get("$ref"), str) else None
        if target is not None:
            groups.append([("$ref", *target)])
        # A boolean or an unresolved alternative is a way out (the compiler judges those).
        return [g for g in groups if all(isinstance(x, dict) for _, x, _ in g)]

    # The subschemas in use, each with the path it was first reached by and its requirements.
    used: dict[int, tuple[dict, str, list[list[Edge]]]] = {}
    todo = [(root, "")]
    while todo:
        node, where = todo.pop()
        if id(node) in used:
            continue
        used[id(node)] = (node, where, needs(node, where))
        todo += [(x, p) for _, x, p in _parts(node, where)]
        todo += [(x, p) for g in used[id(node)][2] for _, x, p in g]

    # Least fixed point, as for a grammar's productive rules: a subschema matches something once
    # each of its requirements has an alternative that does; what is never reached is a loop.
    missing = {i: len(groups) for i, (_, _, groups) in used.items()}
    waiting: dict[int, list[tuple[int, int]]] = defaultdict(list)  # alternative -> (subschema, requirement)
    for i, (_, _, groups) in used.items():
        for g, alternatives in enumerate(groups):
            for _, x, _ in alternatives:
                waiting[id(x)].append((i, g))
    met: set[tuple[int, int]] = set()
    ready = [i for i, n in missing.items() if n == 0]
    while ready:
        for need in waiting[ready.pop()]:
            if need not in met:
                met.add(need)
                missing[need[0]] -= 1
                if missing[need[0]] == 0:
                    ready.append(need[0])
    dead = next((i for i, n in missing.items() if n), None)
    if dead is None:
        return None

    # Walk from a dead subschema through unmet requirements until one repeats: that is the loop.
    steps: list[tuple[int, str]] = []  # (subschema, keyword of the step out of it)
    seen: dict[int, int] = {}
    while dead not in seen:
        seen[dead] = len(steps)
        groups = used[dead][2]
        key, x, _ = groups[next(g for g in range(len(groups)) if (dead, g) not in met)][0]
        steps.append((dead, key))
        dead = id(x)
    loop = steps[seen[dead]:]
    # Only a $ref can lead back up (the rest go down the document), so the loop has one.
    ref_at = next(used[i][1] for i, key in loop if key == "$ref")
    return RefLoop(ref_at, tuple(used[i][1] for i, _ in loop) + (used[dead][1],))


def _members(node: dict, where: str, key: str) -> list[Edge]:
    v = node.get(key)
    return [(key, x, f"{where}.{key}[{i}]") for i, x in enumerate(v)] if isinstance(v, list) else []


def _parts(node: dict, where: str) -> list[Edge]:
    """The object subschemas of `node` that describe parts of its value."""
    edges = [(key, x, f"{where}.{key}.{k}") for key in PART_MAPS if isinstance(node.get(key), dict)
             for k, x in node[key].items()]
    edges += [(key, node[key], f"{where}.{key}") for key in PART_VALUES if key in node]
    edges += _members(node, where, "prefixItems")
    return [e for e in edges if isinstance(e[1], dict)]


def _every_subschema(root: dict) -> Iterator[tuple[dict, str]]:
    """Every object subschema of the document with its path, unused $defs included (where
    `$anchor`s may be)."""
    todo = [(root, "")]
    while todo:
        node, where = todo.pop()
        yield node, where
        todo += [(x, p) for _, x, p in _parts(node, where)]
        todo += [(x, p) for key in SAME_VALUE for _, x, p in _members(node, where, key) if isinstance(x, dict)]
        todo += [(x, f"{where}.{key}.{k}") for key in DEFS if isinstance(node.get(key), dict)
                 for k, x in node[key].items() if isinstance(x, dict)]


def _resolve(root: dict, anchors: dict[str, tuple[dict, str]], ref: str) -> tuple[Any, str] | None:
    """What `ref` points at in `root`, with its path, or None: "#" and "" are the root, "#/a/b" a
    JSON pointer (RFC 6901, percent-decoded), "#name" an `$anchor`; a URI before the "#" must be
    the root's own `$id`."""
    base, _, fragment = ref.partition("#")
    if base and base != root.get("$id"):
        return None
    if fragment and not fragment.startswith("/"):
        return anchors.get(fragment)
    node: Any = root
    path = ""
    for token in fragment.split("/")[1:]:
        token = unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node, path = node[token], f"{path}.{token}"
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node, path = node[int(token)], f"{path}[{token}]"
        else:
            return None
    return node, path
