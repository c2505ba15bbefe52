"""The package's import graph: no module imports one that imports it back, and no arrow runs up
the layers docs/DESIGN.md draws. Read from the source (imports inside functions count; those only
under `if TYPE_CHECKING:` do not), so nothing is imported to check it."""

from __future__ import annotations

import ast
from pathlib import Path

import hybridmoe

ROOT = Path(hybridmoe.__file__).parent

# Lower layers first; a module may import its own layer and those below it.
LAYERS = {
    "settings": 0, "gguf": 0, "tokenizer": 0,
    "gpt_oss_config": 1, "quant_mix": 1,
    "quant": 2,
    "kernels": 3,
    "placement": 4, "synth": 4,
    "models": 5, "convert": 5,
    "engine": 6,
    "server": 7,
    "commands": 8, "cli": 8,
}


def module_names() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("hybridmoe", *path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules `path` imports (`from pkg import mod` counts as importing mod)."""
    found: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.update(a.name for a in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.module and node.level == 0:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    found.add(sub if sub in modules else node.module)

    Visitor().visit(ast.parse(path.read_text()))
    return {m for m in found if m in modules and m != "hybridmoe"}


def graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS[parts[1]] if len(parts) > 1 else None


def test_every_module_has_a_layer():
    assert [m for m in graph() if m != "hybridmoe" and m.split(".")[1] not in LAYERS] == []


def test_no_import_runs_up_the_layers():
    up = [(m, d) for m, deps in graph().items() for d in deps
          if layer(m) is not None and layer(d) > layer(m)]
    assert up == []


def test_no_two_modules_import_each_other_even_through_others():
    g = graph()

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m == goal:
                return True
            if m not in seen:
                seen.add(m)
                todo.extend(g[m])
        return False

    assert [(m, d) for m, deps in g.items() for d in deps if reaches(d, m)] == []
