"""-hf ORG/NAME[:TAG] found in the Hugging Face cache as llama-server picks it, offline; the errors
say what is missing and what to do."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from hybridmoe.gguf import hf_cache

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_with(root: Path, repo: str, files: list[str], ref: str = "main") -> Path:
    """The hub's layout: snapshot entries are symlinks into blobs/."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / ref).write_text(COMMIT)
    (repo_dir / "blobs").mkdir()
    snap = repo_dir / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    for i, f in enumerate(files):
        blob = repo_dir / "blobs" / f"{i:064x}"
        blob.write_bytes(b"GGUF")
        (snap / f).parent.mkdir(parents=True, exist_ok=True)
        (snap / f).symlink_to(blob)
    return snap


@pytest.mark.parametrize("environ,expected", [
    ({"LLAMA_CACHE": "/a", "HF_HUB_CACHE": "/b", "HOME": "/h"}, "/a"),
    ({"HF_HUB_CACHE": "/b", "HF_HOME": "/c"}, "/b"),
    ({"HUGGINGFACE_HUB_CACHE": "/b2", "HF_HOME": "/c"}, "/b2"),
    ({"HF_HOME": "/c", "XDG_CACHE_HOME": "/x"}, "/c/hub"),
    ({"XDG_CACHE_HOME": "/x", "HOME": "/h"}, "/x/huggingface/hub"),
    ({"HOME": "/h"}, "/h/.cache/huggingface/hub"),
])
def test_cache_dir_in_llama_servers_order(environ, expected):
    assert hf_cache.cache_dir(environ) == Path(expected)


@pytest.mark.parametrize("files,tag,expected", [
    (["gpt-oss-20b-mxfp4.gguf"], "", "gpt-oss-20b-mxfp4.gguf"),  # ggml-org/gpt-oss-20b-GGUF
    (["gpt-oss-120b-mxfp4-00002-of-00003.gguf", "gpt-oss-120b-mxfp4-00001-of-00003.gguf",
      "gpt-oss-120b-mxfp4-00003-of-00003.gguf"], "", "gpt-oss-120b-mxfp4-00001-of-00003.gguf"),
    (["m-F16.gguf", "m-Q4_K_M.gguf", "m-Q8_0.gguf"], "", "m-Q4_K_M.gguf"),  # the default tags, in order
    (["m-F16.gguf", "m-Q8_0.gguf"], "", "m-Q8_0.gguf"),
    (["m-F16.gguf", "m-Q8_0.gguf"], "f16", "m-F16.gguf"),  # a tag in any case
    (["mmproj-m-Q8_0.gguf", "m-MXFP4.gguf"], "", "m-MXFP4.gguf"),  # sidecars are never the model
    (["Q8_0/m-Q8_0-00001-of-00002.gguf", "Q8_0/m-Q8_0-00002-of-00002.gguf"], "Q8_0",
     "Q8_0/m-Q8_0-00001-of-00002.gguf"),
    (["m-F16.gguf"], "Q8_0", None),  # a tag that no file has
    (["README.md"], "", None),
])
def test_pick_model(files, tag, expected):
    assert hf_cache.pick_model(sorted(files), tag) == expected


def test_resolve_from_the_cache(tmp_path: Path):
    env = {"HF_HUB_CACHE": str(tmp_path)}
    snap = cache_with(tmp_path, "ggml-org/gpt-oss-20b-GGUF", ["gpt-oss-20b-mxfp4.gguf", "README.md"])
    assert hf_cache.resolve("ggml-org/gpt-oss-20b-GGUF", environ=env) == str(snap / "gpt-oss-20b-mxfp4.gguf")
    assert hf_cache.resolve("ggml-org/gpt-oss-20b-GGUF:MXFP4", environ=env) == str(snap / "gpt-oss-20b-mxfp4.gguf")
    assert hf_cache.resolve("ggml-org/gpt-oss-20b-GGUF", "gpt-oss-20b-mxfp4.gguf", env).endswith("mxfp4.gguf")
    other = cache_with(tmp_path, "org/other", ["x-Q8_0.gguf"], ref="v1")  # no main: any ref
    assert hf_cache.resolve("org/other", environ=env) == str(other / "x-Q8_0.gguf")


@pytest.mark.parametrize("spec,hff,words", [
    ("ggml-org/gpt-oss-120b-GGUF", None, ["is not in the Hugging Face cache", "does not download",
                                          "huggingface-cli download ggml-org/gpt-oss-120b-GGUF", "-m"]),
    ("not a repo", None, ["not a Hugging Face repository name"]),
    ("org/name/extra", None, ["not a Hugging Face repository name"]),
    ("ggml-org/gpt-oss-20b-GGUF:Q4_K_M", None, ["no GGUF model file tagged Q4_K_M", "gpt-oss-20b-mxfp4.gguf"]),
    ("ggml-org/gpt-oss-20b-GGUF", "other.gguf", ["no file other.gguf", "gpt-oss-20b-mxfp4.gguf"]),
])
def test_resolve_errors_say_what_to_do(tmp_path: Path, spec, hff, words):
    env = {"HF_HUB_CACHE": str(tmp_path)}
    cache_with(tmp_path, "ggml-org/gpt-oss-20b-GGUF", ["gpt-oss-20b-mxfp4.gguf"])
    with pytest.raises(ValueError) as e:
        hf_cache.resolve(spec, hff, env)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_serve_takes_the_model_from_the_cache(tmp_path: Path, tiny_gguf: str, monkeypatch):
    """`hybridmoe serve -hf` resolves before anything loads: the cached file is checked (here a
    copy of the suite's tiny model); a missing repository fails in one line."""
    import shutil

    from hybridmoe.cli import main

    snap = cache_with(tmp_path, "org/tiny-GGUF", [])
    shutil.copy(tiny_gguf, snap / "tiny-Q8_0.gguf")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    from hybridmoe.commands import serve

    args = argparse.Namespace(hf_repo="org/tiny-GGUF:Q8_0", hf_file=None, model="ignored.gguf")
    assert serve._model_path(args) == (str(snap / "tiny-Q8_0.gguf"), False)
    with pytest.raises(SystemExit) as e:
        main(["serve", "-hf", "org/missing-GGUF", "--port", "0"])
    assert str(e.value.code).startswith("hybridmoe serve: error: -hf org/missing-GGUF: org/missing-GGUF is not in")


def test_plan_and_generate_take_hf_too(tmp_path: Path, tiny_gguf: str, monkeypatch, capsys):
    from hybridmoe.cli import main

    snap = cache_with(tmp_path, "org/tiny-GGUF", [])
    (snap / "tiny-Q8_0.gguf").symlink_to(tiny_gguf)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert main(["plan", "-hf", "org/tiny-GGUF", "-c", "256"]) == 0
    assert "layers" in capsys.readouterr().out
    assert main(["generate", "-hf", "org/tiny-GGUF", "-p", "Hi", "-n", "2", "-t", "1", "-c", "64"]) == 0
    capsys.readouterr()
    assert main(["plan", "-c", "256"]) == 1
    assert "hybridmoe plan: error: a model is required: -m FILE or -hf ORG/NAME" in capsys.readouterr().err
    assert main(["plan", "-hf", "org/absent"]) == 1
    assert "org/absent is not in the Hugging Face cache" in capsys.readouterr().err


def test_hf_without_a_tag_loads_the_q4_k_m_file(tmp_path: Path, monkeypatch, capsys):
    """unsloth's and bartowski's repositories: -hf with no tag picks Q4_K_M (llama-server's first
    choice), whose Q5_0 / Q4_K / Q8_0 mix then loads and generates."""
    from hybridmoe.cli import main
    from hybridmoe.synth import write_synthetic

    snap = cache_with(tmp_path / "hub", "org/gpt-GGUF", [])
    for tag in ("F16", "Q4_K_M", "Q8_0"):
        write_synthetic(snap / f"gpt-{tag}.gguf", "tiny256", ftype=tag)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hf_cache.resolve("org/gpt-GGUF") == str(snap / "gpt-Q4_K_M.gguf")
    assert main(["generate", "-hf", "org/gpt-GGUF", "-p", "Hi", "-n", "2", "-t", "1", "-c", "64"]) == 0
    assert "decode 2 tok" in capsys.readouterr().err
