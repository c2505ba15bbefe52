"""Metadata rewrites keep tensor data byte for byte; the demo model embeds the package's template."""

from __future__ import annotations

import hashlib
from importlib import resources
from pathlib import Path

import pytest

from hybridmoe.gguf.reader import GGUFFile
from hybridmoe.gguf.rewrite import replace_metadata

DEMO = Path(__file__).resolve().parent.parent / "src" / "hybridmoe" / "data" / "demo.gguf"


def _data_digest(g: GGUFFile) -> str:
    with open(g.path, "rb") as f:
        f.seek(g.data_offset)
        return hashlib.sha256(f.read()).hexdigest()


def test_replace_metadata_keeps_tensors_and_types(tiny_gguf, tmp_path):
    out = tmp_path / "rewritten.gguf"
    replace_metadata(tiny_gguf, out, {"tokenizer.chat_template": "{{ messages[0]['content'] }}" * 7,
                                      "general.extra": "added"})
    a, b = GGUFFile(tiny_gguf), GGUFFile(out)
    assert b.metadata["tokenizer.chat_template"] == "{{ messages[0]['content'] }}" * 7
    assert b.metadata["general.extra"] == "added"
    for key, value in a.metadata.items():
        if key != "tokenizer.chat_template":
            assert b.metadata[key] == value and b.value_types[key] == a.value_types[key], key
    assert b.array_types == a.array_types
    assert _data_digest(a) == _data_digest(b)
    assert {n: t.offset - a.data_offset for n, t in a.tensors.items()} == \
           {n: t.offset - b.data_offset for n, t in b.tensors.items()}
    with pytest.raises(ValueError):
        replace_metadata(out, out, {})


@pytest.mark.skipif(not DEMO.exists(), reason="demo.gguf not built yet (see demo/README.md)")
def test_demo_model_embeds_the_package_template():
    # The copy in the GGUF is what llama.cpp reads with --jinja: keep it the fixed one.
    template = resources.files("hybridmoe.data").joinpath("harmony_template.jinja").read_text()
    assert GGUFFile(DEMO).metadata["tokenizer.chat_template"] == template
