"""`hybridmoe synth`: presets, --layers, --seed, --sparse (the 63 GB 120b file costs no disk and
opens by mmap without reading its data)."""

from __future__ import annotations

import os

import pytest

from hybridmoe.cli import main
from hybridmoe.gguf.reader import open_model
from hybridmoe.models.gpt_oss_config import GptOssConfig


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_sparse_120b_is_full_size_without_disk(tmp_path, capsys):
    path = tmp_path / "120b.gguf"
    assert main(["synth", "--preset", "120b", "--sparse", "--out", str(path)]) == 0
    assert "sparse" in capsys.readouterr().out
    assert os.path.getsize(path) > 63e9 and os.stat(path).st_blocks * 512 < 64 << 20
    rss0 = _rss_bytes()
    m = open_model(path)
    views = [m.raw(name) for name in m.tensors]  # zero-copy views of all 63 GB: nothing is read
    assert _rss_bytes() - rss0 < 256 << 20
    assert sum(v.nbytes for v in views) > 63e9
    cfg = GptOssConfig.from_metadata(m.metadata)
    assert (cfg.n_layers, cfg.n_experts, cfg.n_experts_used, cfg.vocab_size) == (36, 128, 4, 201088)
    assert len(m.metadata["tokenizer.ggml.tokens"]) == 201088
    assert "<|start|>" in m.metadata["tokenizer.chat_template"]
    m.close()


def test_layers_and_seed(tmp_path):
    paths = {}
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        paths[name] = tmp_path / f"{name}.gguf"
        assert main(["synth", "--preset", "tiny", "--layers", "2", "--seed", str(seed), "--out", str(paths[name])]) == 0
    m = open_model(paths["a"])
    assert GptOssConfig.from_metadata(m.metadata).n_layers == 2
    assert not any(name.startswith("blk.2.") for name in m.tensors)
    m.close()
    assert paths["a"].read_bytes() == paths["b"].read_bytes()  # same seed, same file
    assert paths["a"].read_bytes() != paths["c"].read_bytes()


@pytest.mark.parametrize("argv", [["--preset", "70b"], ["--layers", "x"]])
def test_bad_arguments_are_usage_errors(tmp_path, argv):
    with pytest.raises(SystemExit) as e:
        main(["synth", *argv, "--out", str(tmp_path / "x.gguf")])
    assert e.value.code == 2
