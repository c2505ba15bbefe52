"""One flag table: `generate`, `serve` and `plan` share each settings group's flags, defaults, help
and validation; llama-server's `-ngl` spellings; llama-server-only flags set aside, not fatal."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import subprocess
import sys

import pytest

from hybridmoe.commands import generate, plan, serve
from hybridmoe.commands.llama_flags import LLAMA_SERVER_ONLY_FLAGS, parse_llama_command_line, set_aside
from hybridmoe.settings import (
    SAMPLING_DEFAULTS,
    ComputeSettings,
    ContextSettings,
    ParallelSettings,
    PlacementSettings,
    ResidencySettings,
    SamplingDefaults,
    ServerLimits,
    ServerSettings,
    SettingsError,
    add_compute_args,
    add_context_args,
    add_parallel_args,
    add_placement_args,
    add_sampling_args,
)

COMMANDS = {"generate": generate, "serve": serve, "plan": plan}
REQUIRED = {"plan": ["-m", "model.gguf"]}  # plan's -m has no default
# group -> (its add function, the commands that take it)
GROUPS = {
    "placement": (add_placement_args, ("generate", "serve", "plan")),
    "context": (add_context_args, ("generate", "serve", "plan")),
    "parallel": (add_parallel_args, ("serve", "plan")),
    "compute": (add_compute_args, ("generate", "serve")),
    "sampling": (add_sampling_args, ("generate", "serve")),
}


def command_parser(name: str) -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="hybridmoe")
    return COMMANDS[name].add_parser(top.add_subparsers())


def parse(name: str, argv: list[str]) -> argparse.Namespace:
    return command_parser(name).parse_args([*REQUIRED.get(name, []), *argv])


def help_section(parser: argparse.ArgumentParser, title: str) -> str:
    """The lines of `--help` under one argument group's title."""
    lines = parser.format_help().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(title))
    end = next((i for i in range(start + 1, len(lines)) if lines[i] and not lines[i][0].isspace()), len(lines))
    return "\n".join(lines[start:end]).rstrip()


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_shared_groups_are_identical_across_commands(group, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    add, names = GROUPS[group]
    reference = argparse.ArgumentParser(prog="x")
    actions = add(reference)
    title = help_section(reference, next(ln for ln in reference.format_help().splitlines()
                                         if ln.endswith(":") and not ln.startswith(("usage", "options"))))
    for name in names:
        parser = command_parser(name)
        # Same option strings, metavars, choices and help text ...
        assert help_section(parser, title.splitlines()[0]) == title, name
        for action in actions:
            # ... the same defaults, and the same parse of every spelling of each flag.
            assert parser.get_default(action.dest) == action.default, (name, action.dest)
            for flag in action.option_strings:
                if action.nargs == 0:
                    argv = [flag]
                else:
                    argv = [flag, SAMPLE_VALUES.get(action.dest, "3")]
                got = getattr(parser.parse_args([*REQUIRED.get(name, []), *argv]), action.dest)
                assert got == getattr(reference.parse_args(argv), action.dest), (name, flag)


COMMANDS_OF = {PlacementSettings: GROUPS["placement"][1], ContextSettings: GROUPS["context"][1],
               ParallelSettings: GROUPS["parallel"][1], ComputeSettings: GROUPS["compute"][1],
               SamplingDefaults: GROUPS["sampling"][1], ServerLimits: ("serve",), ServerSettings: ("serve",)}
SAMPLE_VALUES = {"override_tensor": "exps=CPU", "gpu_device": "cuda:1", "gpu_dense_dtype": "bf16", "fit": "on",
                 "cache_type_k": "f16", "cache_type_v": "q8_0",
                 "n_gpu_layers": "auto", "temp": "0.5", "top_p": "0.5", "min_p": "0.1", "logit_bias": "15+1"}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("spelling,n_gpu_layers,fit", [
    ([], None, False), (["-ngl", "all"], None, False), (["-ngl", "-1"], None, False), (["-ngl", "ALL"], None, False),
    (["--n-gpu-layers", "0"], 0, False), (["--gpu-layers", "999"], 999, False), (["-ngl", "auto"], None, True),
    (["-ngl", "auto", "--cpu-moe"], None, False), (["-ngl", "auto", "--n-cpu-moe", "3"], None, False),
    (["-ngl", "7", "--fit"], 7, True), (["--fit", "off"], None, False),
])
def test_ngl_spellings(command, spelling, n_gpu_layers, fit):
    p = PlacementSettings.from_args(parse(command, spelling))
    assert (p.n_gpu_layers, p.fit) == (n_gpu_layers, fit)


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("value", ["-2", "lots", "1.5"])
def test_bad_ngl_is_a_usage_error_naming_the_flag(command, value, capsys):
    with pytest.raises(SystemExit) as e:
        parse(command, ["-ngl", value])
    assert e.value.code == 2
    assert "-ngl/--n-gpu-layers" in capsys.readouterr().err


def test_serve_accepts_ngl_minus_one_through_the_cli_parser():
    top = argparse.ArgumentParser(prog="hybridmoe")
    serve.add_parser(top.add_subparsers(dest="command"))
    args = parse_llama_command_line(top, ["serve", "-ngl", "-1", "-ctkd", "q8_0", "--n-cpu-moe", "2"])
    s = serve.ServeSettings.from_args(args)
    assert s.placement == PlacementSettings(n_gpu_layers=None, n_cpu_moe=2) and args.unknown_flags == ["-ctkd", "q8_0"]


@pytest.mark.parametrize("argv,settings,flag", [
    (["--n-cpu-moe", "-1"], PlacementSettings, "--n-cpu-moe"),
    (["--upload-slots", "-1"], PlacementSettings, "--upload-buffers"),  # the old spelling, the new name
    (["--vram-budget", "0"], PlacementSettings, "--vram-budget"),
    (["-c", "-5"], ContextSettings, "-c/--ctx-size"),
    (["-ub", "0"], ContextSettings, "-ub/--ubatch-size"),
    (["-np", "0"], ParallelSettings, "-np/--parallel"),
    (["-t", "0"], ComputeSettings, "-t/--threads"),
    (["--temp", "-1"], SamplingDefaults, "--temp"),
    (["--top-p", "0"], SamplingDefaults, "--top-p"),
    (["-n", "0"], SamplingDefaults, "-n/--n-predict"),
    (["--max-queue", "-1"], ServerLimits, "--max-queue"),
    (["--port", "70000"], ServerSettings, "--port"),
])
def test_validation_names_the_flag_in_every_command(argv, settings, flag):
    for name in COMMANDS_OF[settings]:
        with pytest.raises(SettingsError, match=re.escape(flag) + " must"):
            settings.from_args(parse(name, argv))


class _ReadsRecorded(argparse.Namespace):
    """A Namespace that remembers which of its attributes were read."""

    def __init__(self, ns: argparse.Namespace) -> None:
        super().__init__(**vars(ns))
        object.__setattr__(self, "reads", set())

    def __getattribute__(self, name: str):
        if not name.startswith("_") and name != "reads":
            object.__getattribute__(self, "reads").add(name)
        return object.__getattribute__(self, name)


def test_every_serve_flag_lands_in_a_typed_settings_group():
    parser = command_parser("serve")
    args = _ReadsRecorded(parser.parse_args([]))
    serve.ServeSettings.from_args(args)
    # -m / -hf pick the file (commands/model_source.py); --cache-idle-slots is accepted, always on.
    not_settings = {"help", "version", "model", "hf_repo", "hf_file", "cache_idle_slots"}
    flags = {a.dest for a in parser._actions} - not_settings
    assert flags - args.reads == set()


@pytest.mark.parametrize("argv,pin,noted", [
    ([], False, False), (["--mlock"], True, False), (["-lm", "mlock"], True, False),
    (["-lm", "mmap+mlock"], True, False), (["-lm", "none"], False, True), (["-lm", "dio"], False, True),
    (["--no-mmap"], False, True), (["-lm", "mmap"], False, False),
])
def test_load_modes_as_llama_server_means_them(argv, pin, noted):
    r = ResidencySettings.from_args(parse("serve", argv))
    assert (r.pin, bool(r.notes())) == (pin, noted)


def test_parallel_minus_one_is_llama_servers_auto():
    assert ParallelSettings.from_args(parse("serve", ["-np", "-1"])) == ParallelSettings(n_parallel=4)


def test_library_users_get_the_same_validation():
    with pytest.raises(SettingsError, match="--n-cpu-moe must be >= 0, got -1"):
        PlacementSettings(n_cpu_moe=-1)
    with pytest.raises(SettingsError, match="-ot/--override-tensor"):
        PlacementSettings(override_tensor="exps=CPU")
    with pytest.raises(dataclasses.FrozenInstanceError):
        PlacementSettings().cpu_moe = True  # type: ignore[misc]


@pytest.mark.parametrize("argv,where", [
    (["plan", "-m", "x.gguf", "--n-cpu-moe", "-1"], "hybridmoe plan: error: --n-cpu-moe must be >= 0"),
    (["generate", "-m", "x.gguf", "-c", "-3"], "hybridmoe generate: error: -c/--ctx-size must be >= 0"),
    (["serve", "-m", "x.gguf", "-np", "0"], "hybridmoe serve: error: -np/--parallel must be >= 1"),
])
def test_cli_reports_a_bad_setting_in_one_line(argv, where, capsys):
    from hybridmoe.cli import main

    assert main(argv) in (1, 2)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(where), err


def test_sampling_defaults_are_stated_once():
    from hybridmoe.engine.llm import LLM
    from hybridmoe.engine.sampler import SamplingParams

    d = SAMPLING_DEFAULTS
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed) == (d.temperature, d.top_k, d.top_p, d.min_p, None)
    sig = inspect.signature(LLM.generate).parameters
    assert (sig["temperature"].default, sig["top_k"].default, sig["top_p"].default, sig["min_p"].default,
            sig["max_tokens"].default) == (d.temperature, d.top_k, d.top_p, d.min_p, d.n_predict)
    for name in ("generate", "serve"):
        assert SamplingDefaults.from_args(parse(name, [])) == d


def test_llama_server_only_flags_are_not_ours(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    ours = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", command_parser("serve").format_help()))
    assert not ours & set(LLAMA_SERVER_ONLY_FLAGS)


@pytest.mark.parametrize("argv,kept,foreign", [
    (["-ctkd", "q8_0", "-c", "4096"], ["-c", "4096"], ["-ctkd", "q8_0"]),
    (["-ctkd", "--port", "5"], ["--port", "5"], ["-ctkd"]),  # a missing value never swallows our flag
    (["--lora-scaled", "a.gguf", "0.5", "-t", "2"], ["-t", "2"], ["--lora-scaled", "a.gguf", "0.5"]),
    (["--log-colors=on", "-cb", "-ts", "-1"], [], ["--log-colors=on", "-cb", "-ts", "-1"]),
    (["-ngl", "-1", "--temp", "0"], ["-ngl", "-1", "--temp", "0"], []),
])
def test_set_aside_takes_each_flag_with_its_values(argv, kept, foreign):
    assert set_aside(argv) == (kept, foreign)


def test_neither_import_nor_the_cli_sets_omp_wait_policy(tmp_path):
    """The engine needs no OpenMP setting (bench/api_env.py), so the caller's environment is left
    as it is."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code = "import os, hybridmoe; print(os.environ.get('OMP_WAIT_POLICY'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "None", out.stderr
    code = ("import os, sys; from hybridmoe.cli import main; main(['synth', '--out', sys.argv[1]]); "
            "print(os.environ.get('OMP_WAIT_POLICY'))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "t.gguf")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "None", out.stderr


@pytest.mark.parametrize("k,v,kv_bytes,notes", [
    (None, None, None, 0), ("f32", None, 4.0, 0), ("f16", "f16", 2.0, 0), ("f16", "f32", 4.0, 0),
    ("q8_0", "q8_0", 2.0, 2), ("bf16", None, 2.0, 1),
])
def test_cache_types_as_llama_server_names_them(k, v, kv_bytes, notes):
    argv = (["-ctk", k] if k else []) + (["--cache-type-v", v] if v else [])
    c = ContextSettings.from_args(parse("serve", argv))
    assert (c.cache_type_k, c.cache_type_v, c.kv_bytes) == (k, v, kv_bytes)
    assert len(c.cache_type_notes()) == notes


def test_unknown_cache_type_names_the_flag():
    with pytest.raises(SettingsError, match=r"-ctv/--cache-type-v.*f32, f16"):
        ContextSettings(cache_type_v="q2_k")


@pytest.mark.parametrize("value,want", [("15043+1", (15043, 1.0)), ("15043-inf", (15043, float("-inf"))),
                                        ("7-0.5", (7, -0.5)), ("0+2e3", (0, 2000.0))])
def test_logit_bias_flag_reads_llama_cpp_form(value, want):
    from hybridmoe.settings.sampling_defaults import parse_logit_bias_flag

    assert parse_logit_bias_flag(value) == want


@pytest.mark.parametrize("value", ["abc", "15", "15+inf", "15*2", "-3+1", "15+nan", "15+"])
def test_logit_bias_flag_refuses_other_forms(value):
    from hybridmoe.settings.sampling_defaults import parse_logit_bias_flag

    with pytest.raises(argparse.ArgumentTypeError):
        parse_logit_bias_flag(value)


@pytest.mark.parametrize("argv,ngram,notes", [
    ([], False, 0),
    (["--spec-type", "ngram-simple"], True, 0),
    (["--spec-type", "none"], False, 0),
    (["--spec-type", "ngram-mod,draft-eagle3"], True, 2),  # served as ngram-simple; the draft model one is not
    (["--spec-default"], True, 1),
    (["--spec-type", "draft-simple"], False, 1),
])
def test_speculative_flags(argv, ngram, notes):
    from hybridmoe.settings import SpeculativeSettings, spec_type_notes

    args = parse("serve", argv + ["--spec-ngram-simple-size-n", "6", "--spec-ngram-simple-size-m", "32"])
    s = SpeculativeSettings.from_args(args)
    assert (s.enabled, s.size_n, s.size_m) == (ngram, 6, 32)
    assert len(spec_type_notes(args.spec_type, args.spec_default)) == notes


def test_unknown_spec_type_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        parse("serve", ["--spec-type", "ngram-bogus"])
    assert "unknown speculative type 'ngram-bogus'" in capsys.readouterr().err


def test_llama_servers_other_spec_flags_are_set_aside():
    kept, foreign = set_aside(["--spec-draft-n-max", "16", "--spec-ngram-mod-n-match", "24", "--spec-type",
                               "ngram-mod", "--spec-draft-cpu-moe"])
    assert kept == ["--spec-type", "ngram-mod"]
    assert foreign == ["--spec-draft-n-max", "16", "--spec-ngram-mod-n-match", "24", "--spec-draft-cpu-moe"]


def test_reasoning_budget_flags_are_ours():
    args = parse("serve", ["--reasoning-budget", "128", "--reasoning-budget-message", "Time to answer."])
    assert (args.reasoning_budget, args.reasoning_budget_message) == (128, "Time to answer.")
    assert "--reasoning-budget" not in LLAMA_SERVER_ONLY_FLAGS


def test_sse_ping_interval_flag():
    assert parse("serve", []).sse_ping_interval == 30.0  # llama-server's default
    assert parse("serve", ["--sse-ping-interval", "-1"]).sse_ping_interval == -1


@pytest.mark.parametrize("level,effort", [("high", "high"), ("minimal", "low"), ("xhigh", "high"), ("max", "high"),
                                          ("default", None), ("none", "none")])
def test_reasoning_effort_flag(level, effort):
    assert parse("serve", ["--reasoning-effort", level]).reasoning_effort == effort


def test_llama_server_default_flags_for_requests():
    args = parse("serve", ["--ignore-eos", "--no-cache-prompt", "--skip-chat-parsing"])
    assert (args.ignore_eos, args.cache_prompt, args.skip_chat_parsing) == (True, False, True)
    args = parse("serve", [])
    assert (args.ignore_eos, args.cache_prompt, args.skip_chat_parsing, args.reasoning_effort) == (False, True, False,
                                                                                                   None)


@pytest.mark.parametrize("argv", [["-ncffn", "3"], ["-lzm", "x"], ["-bs"], ["-lcs", "f.bin"]])
def test_single_dash_llama_flags_are_set_aside_whole(argv):
    """Short llama-server flags that argparse would split into ours (-lm as -l m)."""
    kept, foreign = set_aside([*argv, "-c", "8"])
    assert kept == ["-c", "8"] and foreign == argv


def test_serve_version(capsys):
    from hybridmoe import __version__

    with pytest.raises(SystemExit) as e:
        parse("serve", ["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"hybridmoe {__version__}"
