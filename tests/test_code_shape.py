"""Mechanical rules on the source's shape (issue 35): no Python file over 500 lines, and harmony's
markup spelled in one file (plus the synthetic vocabulary builder, which lists every special token)."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "hybridmoe"
MAX_LINES = 500
HARMONY_MARKERS = re.compile(r"<\|(channel|message|call|start|end)\|>")
MARKER_FILES = {"tokenizer/harmony.py", "tokenizer/synthetic.py"}
# Other chat formats whose own tokens are spelled like one of harmony's: Phi-3's turn end `<|end|>`.
OTHER_FORMATS = {"tokenizer/llama_templates.py": {"<|end|>"}}


def _sources() -> dict[str, str]:
    """Every .py file under the package, by its path relative to it."""
    return {p.relative_to(PACKAGE).as_posix(): p.read_text(encoding="utf-8") for p in sorted(PACKAGE.rglob("*.py"))}


def test_the_package_is_found():
    assert "tokenizer/harmony.py" in _sources()


def test_no_python_file_is_over_500_lines():
    too_long = {name: text.count("\n") for name, text in _sources().items() if text.count("\n") > MAX_LINES}
    assert not too_long, f"over {MAX_LINES} lines; split along a real seam: {too_long}"


def test_harmony_markers_live_in_one_file():
    strays = {name: found for name, text in _sources().items() if name not in MARKER_FILES
              if (found := sorted({m.group(0) for m in HARMONY_MARKERS.finditer(text)} - OTHER_FORMATS.get(name, set())))}
    assert not strays, f"harmony markup outside {sorted(MARKER_FILES)} (take it from the chat format): {strays}"


IMPORT = re.compile(r"^from hybridmoe\.([\w.]+) import \(?([^)\n]*)", re.M)


def test_no_module_imports_another_modules_private_names():
    """A leading underscore means "this module's own"; a package may still use its private
    submodules (kernels._lib)."""
    strays = []
    for name, text in _sources().items():
        package = name.rsplit("/", 1)[0].replace("/", ".") if "/" in name else ""
        for module, names in IMPORT.findall(text):
            private = [n.strip() for n in names.split(",") if n.strip().startswith("_")]
            if private and module != package:
                strays.append(f"{name}: from hybridmoe.{module} import {', '.join(private)}")
    assert not strays, strays
