"""`hybridmoe serve` flag parsing: llama-server's names, unknown flags tolerated, placement pass-through."""

from __future__ import annotations

import argparse
import logging

import pytest

from hybridmoe.commands import serve
from hybridmoe.commands.llama_flags import parse_llama_command_line
from hybridmoe.settings import PlacementSettings, ServerSettings

LLAMA_LINE = ("-m model.gguf --n-cpu-moe 36 --n-gpu-layers 999 -c 0 -fa --jinja --reasoning-format none "
              "--host 0.0.0.0 --port 8502 --api-key dummy").split()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    serve.add_parser(sub)
    return parse_llama_command_line(parser, ["serve", *argv])


def placement(argv: list[str]) -> PlacementSettings:
    return serve.ServeSettings.from_args(parse(argv)).placement


def test_llama_server_command_line():
    args = parse(LLAMA_LINE)
    assert (args.model, args.host, args.port, args.ctx_size) == ("model.gguf", "0.0.0.0", 8502, 0)
    assert args.flash_attn == "on" and args.jinja and args.reasoning_format == "none"
    assert ServerSettings.from_args(args).api_keys() == ["dummy"]
    settings = serve.ServeSettings.from_args(args)
    assert settings.placement == PlacementSettings(n_gpu_layers=999, n_cpu_moe=36)
    assert settings.parallel.n_parallel == 4
    assert args.unknown_flags == []


def test_defaults_match_llama_server():
    args = parse([])
    assert (args.host, args.port) == ("127.0.0.1", 8080)
    assert (args.temp, args.top_k, args.top_p, args.min_p) == (0.8, 40, 0.95, 0.05)
    assert args.reasoning_format == "auto" and args.flash_attn == "auto" and not args.metrics
    assert placement([]) == PlacementSettings()


def test_unknown_llama_flags_are_kept_not_fatal():
    args = parse(["--ctx-checkpoints", "8", "--swa-full", "-fa", "off", "--cont-batching", "--temp", "1.0"])
    assert args.unknown_flags == ["--cont-batching"] and args.swa_full
    assert args.flash_attn == "off" and args.temp == 1.0 and args.ctx_checkpoints == 8


def test_unknown_short_flags_do_not_split_into_ours():
    # argparse alone would read `-ctkd q8_0` as `-c tkd` and `-tb 8` as `-t b`; -ctk is ours.
    args = parse(["-ctkd", "q8_0", "-ctk", "q8_0", "-tb", "8", "-cb", "-c", "4096", "-t", "2", "-kvu"])
    assert (args.ctx_size, args.threads, args.cache_type_k) == (4096, 2, "q8_0")
    assert args.unknown_flags == ["-ctkd", "q8_0", "-tb", "8", "-cb", "-kvu"]


def test_repeatable_flags_and_placement():
    args = parse(["--api-key", "a,b", "--api-key", "c", "-ot", r"blk\.1\.ffn_.*_exps=CPU,blk\.2\..*=CUDA0",
                  "-ot", "exps=CPU", "--cpu-moe", "-a", "my-model", "--chat-template-kwargs",
                  '{"reasoning_effort": "high"}'])
    assert ServerSettings.from_args(args).api_keys() == ["a", "b", "c"]
    # -ot values travel as given; placement.rules.parse_overrides is the one place that splits them
    assert serve.ServeSettings.from_args(args).placement == PlacementSettings(
        cpu_moe=True, override_tensor=(r"blk\.1\.ffn_.*_exps=CPU,blk\.2\..*=CUDA0", "exps=CPU"))
    assert args.alias == "my-model" and args.chat_template_kwargs == {"reasoning_effort": "high"}


def test_api_key_file_and_env(tmp_path, monkeypatch):
    keys = tmp_path / "keys.txt"
    keys.write_text("k1\n\n  k2  \n")
    monkeypatch.setenv("LLAMA_API_KEY", "from-env")
    def api_keys(argv: list[str]) -> list[str]:
        return ServerSettings.from_args(parse(argv)).api_keys()

    assert api_keys(["--api-key-file", str(keys)]) == ["from-env", "k1", "k2"]
    # the newest llama-server takes both (checked: LLAMA_API_KEY=a llama-server --api-key b accepts a and b)
    assert api_keys(["--api-key", "cli", "--api-key-file", str(keys)]) == ["from-env", "cli", "k1", "k2"]
    monkeypatch.delenv("LLAMA_API_KEY")
    assert api_keys([]) == []


@pytest.mark.parametrize("argv", [["--chat-template-kwargs", "[1]"], ["--chat-template-kwargs", "{bad"],
                                  ["--reasoning-format", "maybe"], ["-fa", "sometimes"], ["--port", "x"]])
def test_bad_values_are_rejected(argv):
    with pytest.raises(SystemExit):
        parse(argv)


def test_missing_model_file_is_a_clear_error(tmp_path):
    args = parse(["-m", str(tmp_path / "absent.gguf")])
    with pytest.raises(SystemExit, match="model file not found"):
        serve._model_path(args)


def test_no_model_serves_demo_or_an_honestly_random_one(tmp_path, monkeypatch):
    import hybridmoe.engine.llm as llm_mod

    monkeypatch.setattr(llm_mod, "DEMO_MODEL", tmp_path / "absent-demo.gguf")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path, is_random = serve._model_path(parse([]))
    assert is_random and path.startswith(str(tmp_path / "cache")) and path.endswith(".gguf")
    from hybridmoe.gguf.reader import open_model

    assert open_model(path).metadata["general.architecture"] == "gpt-oss"
    bundled = tmp_path / "demo.gguf"
    bundled.write_bytes(b"stand-in")
    monkeypatch.setattr(llm_mod, "DEMO_MODEL", bundled)
    assert serve._model_path(parse([])) == (str(bundled), False)


def test_unloadable_model_exits_with_a_clear_error(tmp_path, capsys):
    from hybridmoe.cli import main

    from .conftest import free_port

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)  # right magic, garbage header
    try:
        assert main(["serve", "-m", str(bad), "--port", str(free_port())]) == 1  # refused before binding
    finally:
        logging.captureWarnings(False)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "broken.gguf" in err[0] and "GGUF version 0" in err[0], err


@pytest.mark.parametrize("flag", ["--slot-save-path", "--prompt-cache-dir", "--responses-dir"])
def test_directories_that_cannot_be_made_fail_before_the_port_is_bound(flag, tmp_path, tiny_gguf):
    from hybridmoe.cli import main

    (tmp_path / "a-file").write_text("x")
    bad = tmp_path / "a-file" / "cache"
    with pytest.raises(SystemExit) as e:
        main(["serve", "-m", tiny_gguf, flag, str(bad), "--port", "0"])
    assert str(e.value.code) == f"hybridmoe serve: {flag} {bad}: Not a directory"
