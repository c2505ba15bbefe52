"""A model file that is valid GGUF but not a usable gpt-oss gets a clear error before loading."""

from __future__ import annotations

import pytest

from hybridmoe.gguf.errors import GGUFError
from hybridmoe.gguf.reader import open_model
from hybridmoe.gguf.writer import TensorSpec, write_gguf
from hybridmoe.models.gpt_oss import GptOss
from hybridmoe.synth import PRESETS, synth_metadata, synth_tensors


def _write(path, mutate_meta=None, mutate_tensors=None):
    p = PRESETS["tiny"]
    meta = synth_metadata(p, 0)
    tensors = synth_tensors(p, 0, sparse=False)
    if mutate_meta:
        mutate_meta(meta)
    if mutate_tensors:
        tensors = mutate_tensors(tensors)
    write_gguf(path, meta, tensors)
    return path


def _load(path):
    return GptOss(open_model(path))


def test_unsupported_architecture(tmp_path):
    path = _write(tmp_path / "a.gguf", mutate_meta=lambda m: m.__setitem__("general.architecture", "llama"))
    with pytest.raises(GGUFError, match="unsupported architecture 'llama'"):
        _load(path)


def test_missing_metadata_key(tmp_path):
    path = _write(tmp_path / "a.gguf", mutate_meta=lambda m: m.pop("gpt-oss.expert_count"))
    with pytest.raises(GGUFError, match="gpt-oss.expert_count"):
        _load(path)


def test_missing_tensor(tmp_path):
    path = _write(tmp_path / "a.gguf", mutate_tensors=lambda ts: [t for t in ts if t.name != "blk.1.attn_sinks.weight"])
    with pytest.raises(GGUFError, match="blk.1.attn_sinks.weight"):
        _load(path)


def test_mis_shaped_tensor(tmp_path):
    def shrink(ts):
        out = []
        for t in ts:
            if t.name == "blk.2.attn_q.bias":
                import numpy as np

                t = TensorSpec(t.name, t.ggml_type, (t.ne[0] // 2,), np.zeros(t.ne[0] // 2, np.float32))
            out.append(t)
        return out

    path = _write(tmp_path / "a.gguf", mutate_tensors=shrink)
    with pytest.raises(GGUFError, match=r"blk.2.attn_q.bias.*expected"):
        _load(path)


def test_inconsistent_heads(tmp_path):
    path = _write(tmp_path / "a.gguf", mutate_meta=lambda m: m.__setitem__("gpt-oss.attention.head_count_kv", 3))
    with pytest.raises(GGUFError, match="head_count"):
        _load(path)
