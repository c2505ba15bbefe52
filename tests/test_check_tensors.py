"""--check-tensors: a file with one inf/NaN block scale (or float value) is refused in one line naming
file, tensor, place and value, for every tensor type we read; clean files pass; without the flag
nothing is scanned."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hybridmoe.commands import generate, serve
from hybridmoe.commands.llama_flags import parse_llama_command_line
from hybridmoe.gguf.constants import BLOCK_SIZES
from hybridmoe.gguf.errors import GGUFError
from hybridmoe.gguf.reader import TensorInfo, open_model
from hybridmoe.quant.check import check_tensors
from hybridmoe.quant_mix import MIXES
from hybridmoe.settings import ChatSettings, LoadSettings
from hybridmoe.synth import write_synthetic
from tests.damaged_files import ALL_TYPES, TARGET, T, block_offset, cli_fails, model_with, patch

ROW = 5  # the damaged row; its last block (or element 200) is the damaged one
FLOAT_BAD = {T.F32: (np.float32(np.inf).tobytes(), "inf"), T.F16: (np.float16(np.nan).tobytes(), "nan"),
             T.BF16: (np.array([0xFF80], np.uint16).tobytes(), "-inf")}
# (type, scale field, its byte offset in a block, bytes written, value shown)
NAN16, NEG_INF16 = np.float16(np.nan).tobytes(), np.float16(-np.inf).tobytes()
SCALES = [
    (T.Q8_0, "d", 0, NAN16, "nan"), (T.MXFP4, "e", 0, b"\xff", "255 (the E8M0 NaN code)"),
    (T.Q4_0, "d", 0, NAN16, "nan"), (T.Q4_1, "d", 0, NAN16, "nan"), (T.Q4_1, "m", 2, NEG_INF16, "-inf"),
    (T.Q5_0, "d", 0, NEG_INF16, "-inf"), (T.Q5_1, "d", 0, NAN16, "nan"), (T.Q5_1, "m", 2, NAN16, "nan"),
    (T.IQ4_NL, "d", 0, NAN16, "nan"), (T.IQ4_XS, "d", 0, NEG_INF16, "-inf"),
    (T.Q2_K, "d", 80, NAN16, "nan"), (T.Q2_K, "dmin", 82, NEG_INF16, "-inf"), (T.Q3_K, "d", 108, NAN16, "nan"),
    (T.Q4_K, "d", 0, NEG_INF16, "-inf"), (T.Q4_K, "dmin", 2, NAN16, "nan"), (T.Q5_K, "d", 0, NAN16, "nan"),
    (T.Q5_K, "dmin", 2, NEG_INF16, "-inf"), (T.Q6_K, "d", 208, NAN16, "nan"),
]


@pytest.fixture(scope="module")
def clean_files(tmp_path_factory) -> dict[T, tuple[Path, TensorInfo]]:
    """tiny256 with TARGET of each type, written once; tests damage copies."""
    d = tmp_path_factory.mktemp("clean")
    return {t: (d / f"{t.name}.gguf", model_with(d / f"{t.name}.gguf", t)) for t in ALL_TYPES}


def _damaged(tmp_path: Path, clean: tuple[Path, TensorInfo], at: int, data: bytes) -> Path:
    path = tmp_path / "model.gguf"
    shutil.copyfile(clean[0], path)
    patch(path, at, data)
    return path


def _bad_scale(tmp_path: Path, clean_files, t: T, field_at: int, data: bytes) -> tuple[Path, int]:
    """A copy of t's file whose TARGET has `data` at a scale field of row ROW's last block."""
    info = clean_files[t][1]
    last = info.ne[0] // BLOCK_SIZES[t][0] - 1
    return _damaged(tmp_path, clean_files[t], block_offset(info, ROW, last) + field_at, data), last


def _bad_value(tmp_path: Path, clean_files, t: T) -> Path:
    info = clean_files[t][1]
    size = BLOCK_SIZES[t][1]
    return _damaged(tmp_path, clean_files[t], info.offset + (ROW * info.ne[0] + 200) * size, FLOAT_BAD[t][0])


def _expected_scale(path: Path, t: T, field: str, block: int, shown: str) -> str:
    return f"{path}: tensor '{TARGET}' ({t.name}): block {block} of row {ROW} has scale {field} = {shown}"


def _expected_value(path: Path, t: T) -> str:
    return f"{path}: tensor '{TARGET}' ({t.name}): value {FLOAT_BAD[t][1]} at element 200 of row {ROW}"


def _check(path: Path, chunk_bytes: int | None = None) -> int:
    with open_model(path) as mf:
        return check_tensors(mf) if chunk_bytes is None else check_tensors(mf, chunk_bytes)


# ---- the function ----------------------------------------------------------------------------------

@pytest.mark.parametrize("t,field,at,data,shown", SCALES, ids=[f"{s[0].name}-{s[1]}" for s in SCALES])
def test_a_bad_scale_names_file_tensor_block_and_value(tmp_path: Path, clean_files, t, field, at, data, shown):
    path, block = _bad_scale(tmp_path, clean_files, t, at, data)
    with pytest.raises(GGUFError) as e:
        _check(path)
    assert str(e.value) == _expected_scale(path, t, field, block, shown)
    with pytest.raises(GGUFError) as e:  # chunks far smaller than a row: the same place
        _check(path, chunk_bytes=100)
    assert str(e.value) == _expected_scale(path, t, field, block, shown)


@pytest.mark.parametrize("t", list(FLOAT_BAD), ids=lambda t: t.name)
def test_a_bad_float_value_names_file_tensor_element_and_value(tmp_path: Path, clean_files, t):
    path = _bad_value(tmp_path, clean_files, t)
    for chunk in (None, 64):
        with pytest.raises(GGUFError) as e:
            _check(path, chunk)
        assert str(e.value) == _expected_value(path, t)


def test_clean_files_of_every_type_and_mix_pass(tmp_path: Path, clean_files):
    for path, _ in clean_files.values():
        with open_model(path) as mf:
            assert check_tensors(mf) == sum(i.nbytes for i in mf.tensors.values())
    for ftype in MIXES:
        _check(Path(write_synthetic(tmp_path / f"{ftype}.gguf", "tiny256", ftype=ftype, quantized_experts=True)))


def test_an_f16_scale_that_is_large_or_tiny_is_not_refused(tmp_path: Path, clean_files):
    """Only inf and NaN are refused: 65504, subnormals and -0 are values a real file can hold."""
    for value in (65504.0, -65504.0, 6e-8, -0.0):
        path, _ = _bad_scale(tmp_path, clean_files, T.Q4_K, 0, np.float16(value).tobytes())
        _check(path)


# ---- the commands ----------------------------------------------------------------------------------

def _damaged_with_message(tmp_path: Path, clean_files, t) -> tuple[Path, str]:
    """A copy of t's clean file with one bad value or scale, and the message that must name it."""
    if t in FLOAT_BAD:
        path = _bad_value(tmp_path, clean_files, t)
        return path, _expected_value(path, t)
    _, field, at, data, shown = next(s for s in SCALES if s[0] == t)
    path, block = _bad_scale(tmp_path, clean_files, t, at, data)
    return path, _expected_scale(path, t, field, block, shown)



@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_serve_check_tensors_is_one_line(tmp_path: Path, clean_files, t):
    path, expected = _damaged_with_message(tmp_path, clean_files, t)
    assert cli_fails("serve", "-m", str(path), "--port", "0", "--check-tensors") == \
        f"hybridmoe serve: error: {expected}"


@pytest.mark.parametrize("t", [T.BF16, T.MXFP4, T.Q5_1, T.Q3_K], ids=lambda t: t.name)
def test_generate_check_tensors_is_one_line(tmp_path: Path, clean_files, t):
    path, expected = _damaged_with_message(tmp_path, clean_files, t)
    assert cli_fails("generate", "-m", str(path), "-n", "1", "--check-tensors") == \
        f"hybridmoe generate: error: {expected}"


def test_generate_checks_a_clean_file_and_runs(clean_files):
    p = subprocess.run([sys.executable, "-m", "hybridmoe.cli", "generate", "-m", str(clean_files[T.Q8_0][0]),
                        "-n", "1", "-t", "1", "--check-tensors"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "finish:" in p.stderr, p.stderr


def test_llama_arg_check_tensors_turns_it_on(tmp_path: Path, clean_files):
    path, block = _bad_scale(tmp_path, clean_files, T.Q6_K, 208, NAN16)
    env = {**os.environ, "LLAMA_ARG_CHECK_TENSORS": "1"}
    p = subprocess.run([sys.executable, "-m", "hybridmoe.cli", "serve", "-m", str(path), "--port", "0"],
                       capture_output=True, text=True, timeout=60, env=env)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]  # serve says which variables it read
    assert p.returncode == 1 and "settings from the environment: LLAMA_ARG_CHECK_TENSORS" in lines[0], lines
    assert lines[1:] == [f"hybridmoe serve: error: {_expected_scale(path, T.Q6_K, 'd', block, 'nan')}"]


def _serve_args(argv: list[str], environ: dict[str, str]) -> argparse.Namespace:
    top = argparse.ArgumentParser(prog="hybridmoe")
    serve.add_parser(top.add_subparsers(dest="command"))
    return parse_llama_command_line(top, ["serve", *argv], environ)


@pytest.mark.parametrize("argv,environ,on", [
    ([], {}, False), (["--check-tensors"], {}, True), ([], {"LLAMA_ARG_CHECK_TENSORS": "true"}, True),
    ([], {"LLAMA_ARG_CHECK_TENSORS": "off"}, False), (["--check-tensors"], {"LLAMA_ARG_CHECK_TENSORS": "0"}, True),
])
def test_the_flag_and_its_variable_reach_the_settings(argv, environ, on):
    args = _serve_args(argv, environ)
    assert serve.ServeSettings.from_args(args).load == LoadSettings(check_tensors=on)
    assert args.unknown_flags == []  # no longer set aside with a warning


def test_the_flag_is_in_both_commands_help(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    top = argparse.ArgumentParser(prog="hybridmoe")
    sub = top.add_subparsers(dest="command")
    for command in (serve, generate):
        text = command.add_parser(sub).format_help()
        assert "--check-tensors" in text and "invalid values" in text


def test_without_the_flag_nothing_is_scanned(tmp_path: Path, clean_files, monkeypatch):
    path, _ = _bad_scale(tmp_path, clean_files, T.Q4_0, 0, NAN16)
    import hybridmoe.quant.check as check

    def never(*a, **k):
        raise AssertionError("scanned without --check-tensors")

    monkeypatch.setattr(check, "check_tensors", never)
    serve._preflight(ChatSettings(), str(path), LoadSettings())  # header and metadata only: passes
    with pytest.raises(AssertionError, match="scanned"):
        serve._preflight(ChatSettings(), str(path), LoadSettings(check_tensors=True))
