"""`hybridmoe synth`: presets, --layers, --seed, --sparse (the 63 GB 120b file costs no disk and
opens by mmap without reading its data)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace

import pytest

from hybridmoe.cli import main
from hybridmoe.gguf.reader import open_model
from hybridmoe.models.gpt_oss_config import GptOssConfig
from hybridmoe.synth import PRESETS, synth_metadata


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


# sha256 of files written before presets became model configs: the move must not change a byte.
# (20b: the header region of the sparse file, whose data is a hole.)
GOLDEN = [
    (["--preset", "tiny"], None, "b88d1c1fa0351d4c5edb05db6c840e815d67a44f4a6b549bc3736acb45b7e272"),
    (["--preset", "tiny", "--layers", "2", "--seed", "3"], None,
     "04085cfa2f3d2feafde5d9b7f68fa069c1c15dbc2eacd28aed308a6d34470081"),
    (["--preset", "20b", "--sparse"], 64 << 20, "8bd416ae2a9f3f08d6acb76214bec3fe311cccaffdf7b2096ea703fa50097884"),
]


@pytest.mark.parametrize("argv, prefix, digest", GOLDEN)
def test_files_are_byte_identical_to_before(tmp_path, argv, prefix, digest):
    path = tmp_path / "x.gguf"
    assert main(["synth", *argv, "--out", str(path)]) == 0
    with open(path, "rb") as f:
        assert hashlib.sha256(f.read(prefix) if prefix else f.read()).hexdigest() == digest


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_metadata_reads_back_to_its_config(name):
    p = PRESETS[name]
    assert GptOssConfig.from_metadata(synth_metadata(p, 0)) == p.config


def test_config_metadata_round_trip_off_defaults():
    c = replace(PRESETS["tiny"].config, rope_scaling_factor=1.0, rope_original_ctx=8192,
                yarn_beta_fast=16.0, yarn_beta_slow=2.0)
    meta = {"general.architecture": "gpt-oss", **c.to_metadata(), "gpt-oss.vocab_size": c.vocab_size}
    assert GptOssConfig.from_metadata(meta) == c
