"""A llama-server setup beyond its flags: LLAMA_ARG_* environment variables (as container setups
give them), --api-prefix, --no-ui, HTTPS (--ssl-key-file / --ssl-cert-file), --log-file and
-lm/--load-mode. Parsing is checked on the parser; each server-side effect on a real process."""

from __future__ import annotations

import argparse
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridmoe.commands import serve
from hybridmoe.commands.llama_flags import LLAMA_ENV_FLAGS, LLAMA_SERVER_ONLY_FLAGS, parse_llama_command_line
from hybridmoe.settings import ServerSettings, WebSettings
from hybridmoe.settings.loading import LOAD_MODES

from .conftest import API_KEY, ServerProcess, start_server, stop_server


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="hybridmoe")
    serve.add_parser(top.add_subparsers(dest="command"))
    return top


def parse(argv: list[str], environ: dict[str, str]) -> argparse.Namespace:
    return parse_llama_command_line(parser(), ["serve", *argv], environ)


# ---- the environment, parsed ----------------------------------------------------------------------------

def test_variables_become_their_flags():
    args = parse([], {"LLAMA_ARG_MODEL": "m.gguf", "LLAMA_ARG_CTX_SIZE": "8192", "LLAMA_ARG_N_PARALLEL": "2",
                      "LLAMA_ARG_HOST": "0.0.0.0", "LLAMA_ARG_PORT": "9001", "LLAMA_ARG_FLASH_ATTN": "on",
                      "LLAMA_ARG_N_CPU_MOE": "36", "LLAMA_ARG_N_PREDICT": "-1", "LLAMA_ARG_THINK": "none",
                      "LLAMA_ARG_CHAT_TEMPLATE_KWARGS": '{"reasoning_effort": "high"}', "HOME": "/root"})
    assert (args.model, args.ctx_size, args.parallel, args.host, args.port) == ("m.gguf", 8192, 2, "0.0.0.0", 9001)
    assert (args.flash_attn, args.n_cpu_moe, args.n_predict, args.reasoning_format) == ("on", 36, -1, "none")
    assert args.chat_template_kwargs == {"reasoning_effort": "high"}
    assert sorted(args.env_used) == sorted(["LLAMA_ARG_MODEL", "LLAMA_ARG_CTX_SIZE", "LLAMA_ARG_N_PARALLEL",
                                            "LLAMA_ARG_HOST", "LLAMA_ARG_PORT", "LLAMA_ARG_FLASH_ATTN",
                                            "LLAMA_ARG_N_CPU_MOE", "LLAMA_ARG_N_PREDICT", "LLAMA_ARG_THINK",
                                            "LLAMA_ARG_CHAT_TEMPLATE_KWARGS"])
    assert args.unknown_flags == [] and args.env_notes == []


def test_the_command_line_wins():
    args = parse(["-c", "4096", "--port", "8080"], {"LLAMA_ARG_CTX_SIZE": "8192", "LLAMA_ARG_PORT": "9001"})
    assert (args.ctx_size, args.port) == (4096, 8080)


@pytest.mark.parametrize("environ,expected", [
    ({"LLAMA_ARG_ENDPOINT_METRICS": "true"}, {"metrics": True}),
    ({"LLAMA_ARG_ENDPOINT_METRICS": "0"}, {"metrics": False}),
    ({"LLAMA_ARG_ENDPOINT_SLOTS": "disabled"}, {"slots": False}),
    ({"LLAMA_ARG_NO_ENDPOINT_SLOTS": "1"}, {"slots": False}),
    ({"LLAMA_ARG_CACHE_PROMPT": "off"}, {"cache_prompt": False}),
    ({"LLAMA_ARG_CONTEXT_SHIFT": "ON"}, {"context_shift": True}),
    ({"LLAMA_ARG_NO_UI": "1"}, {"ui": False}),
    ({"LLAMA_ARG_CPU_MOE": "enabled", "LLAMA_ARG_SWA_FULL": "1"}, {"cpu_moe": True, "swa_full": True}),
])
def test_switches(environ, expected):
    args = parse([], environ)
    assert {k: getattr(args, k) for k in expected} == expected


def test_a_switch_without_a_no_form_ignores_other_words_as_llama_server_does():
    args = parse([], {"LLAMA_ARG_JINJA": "yes"})
    assert not args.jinja and args.env_used == []
    assert args.env_notes == ["environment variable LLAMA_ARG_JINJA='yes' is not on/true/1/enabled: --jinja stays off"]


@pytest.mark.parametrize("environ,message", [
    ({"LLAMA_ARG_CTX_SIZE": "lots"}, "environment variable LLAMA_ARG_CTX_SIZE: invalid value 'lots' for --ctx-size"),
    ({"LLAMA_ARG_THINK": "sometimes"}, "environment variable LLAMA_ARG_THINK: 'sometimes' for --reasoning-format is "
                                       "not one of none, auto, deepseek"),
    ({"LLAMA_ARG_ENDPOINT_SLOTS": "maybe"}, "environment variable LLAMA_ARG_ENDPOINT_SLOTS: expected on/off"),
    ({"LLAMA_ARG_LOAD_MODE": "fast"}, "environment variable LLAMA_ARG_LOAD_MODE: 'fast' for --load-mode"),
])
def test_a_bad_value_is_a_usage_error_naming_the_variable(environ, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse([], environ)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_variables_of_flags_set_aside_are_noted_not_applied():
    args = parse([], {"LLAMA_ARG_N_CPU_FFN": "3", "LLAMA_ARG_DEFRAG_THOLD": "0.1", "LLAMA_ARG_NO_KV_OFFLOAD": "1"})
    assert args.unknown_flags == [] and args.env_used == []
    assert sorted(args.env_notes) == [
        "ignoring environment variable LLAMA_ARG_DEFRAG_THOLD (--defrag-thold): it has no meaning in hybridmoe",
        "ignoring environment variable LLAMA_ARG_NO_KV_OFFLOAD (--kv-offload): it has no meaning in hybridmoe",
        "ignoring environment variable LLAMA_ARG_N_CPU_FFN (--n-cpu-ffn): it has no meaning in hybridmoe",
    ]


def test_a_no_variable_counts_only_for_a_flag_with_a_no_form():
    """LLAMA_ARG_NO_HOST is --no-host's own variable, not a --no- form of --host: one note, host kept."""
    args = parse([], {"LLAMA_ARG_NO_HOST": "1"})
    assert args.host == "127.0.0.1" and args.env_used == []
    assert args.env_notes == ["ignoring environment variable LLAMA_ARG_NO_HOST (--no-host): it has no meaning in "
                              "hybridmoe"]


def test_every_variable_names_a_flag_we_take_or_set_aside():
    ours = parser()._subparsers._group_actions[0].choices["serve"]._option_string_actions
    stray = {env: flag for env, flag in LLAMA_ENV_FLAGS.items()
             if flag not in ours and flag not in LLAMA_SERVER_ONLY_FLAGS}
    assert stray == {}


def test_env_api_key_and_key_file(tmp_path: Path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# the team's keys\nfile-key\n\n#old-key\n")
    args = parse(["--api-key", "cli-key"], {"LLAMA_API_KEY": "env-key", "LLAMA_ARG_API_KEY_FILE": str(keys)})
    assert ServerSettings.from_args(args).api_keys() == ["env-key", "cli-key", "file-key"]


def ui_settings(argv: list[str], environ: dict[str, str]) -> dict:
    return WebSettings.from_args(parse(argv, environ)).ui_settings()


def test_ui_config(tmp_path: Path, capsys):
    assert ui_settings(["--webui-config", '{"temperature": 0.2}'], {}) == {"temperature": 0.2}
    f = tmp_path / "ui.json"
    f.write_text('{"systemMessage": "Hi"}')
    assert ui_settings(["--ui-config-file", str(f)], {}) == {"systemMessage": "Hi"}
    assert ui_settings([], {"LLAMA_ARG_UI_CONFIG_FILE": str(f)}) == {"systemMessage": "Hi"}
    assert ui_settings([], {}) == {}
    f.write_text("[1]")
    with pytest.raises(ValueError, match="--ui-config-file .*expected a JSON object"):
        ui_settings(["--ui-config-file", str(f)], {})
    with pytest.raises(SystemExit):
        parse(["--ui-config", "{nope"], {})
    assert "--ui-config" in capsys.readouterr().err


@pytest.mark.parametrize("value,prefix", [("/api", "/api"), ("api", "/api"), ("/api/", "/api"), ("/a/b", "/a/b"),
                                          ("/", "")])
def test_api_prefix_spellings(value, prefix):
    assert parse(["--api-prefix", value], {}).api_prefix == prefix


@pytest.mark.parametrize("mode,mlock,no_mmap", [
    ("auto", False, False), ("mmap", False, False), ("none", False, True), ("mlock", True, False),
    ("mmap+mlock", True, False), ("dio", False, True)])
def test_load_modes(mode, mlock, no_mmap):
    args = parse(["-lm", mode], {})
    assert LOAD_MODES[args.load_mode] == (mlock, no_mmap)


# ---- real servers ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def env_server(served_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Configured the way a container is: the model, slots, alias, key and prefix from the environment."""
    tmp = tmp_path_factory.mktemp("env")
    env = {"LLAMA_ARG_MODEL": served_model, "LLAMA_ARG_N_PARALLEL": "3", "LLAMA_ARG_ALIAS": "env-model",
           "LLAMA_API_KEY": API_KEY, "LLAMA_ARG_API_PREFIX": "/llm", "LLAMA_ARG_THREADS": "1",
           "LLAMA_ARG_LOG_FILE": str(tmp / "file.log"), "LLAMA_ARG_N_CPU_FFN": "2",
           "LLAMA_ARG_UI_CONFIG": '{"systemMessage": "Be brief.", "temperature": 0.5}'}
    srv = start_server(None, [], tmp / "server.log", API_KEY, prefix="/llm", env=env)
    yield srv
    stop_server(srv)


def test_a_server_configured_by_the_environment(env_server: ServerProcess):
    status, props = env_server.request("GET", "/props")
    assert status == 200 and props["total_slots"] == 3
    assert props["ui_settings"] == {"systemMessage": "Be brief.", "temperature": 0.5} and props["ui"] is True
    status, models = env_server.request("GET", "/v1/models")
    assert status == 200 and models["data"][0]["id"] == "env-model"
    status, reply = env_server.request("POST", "/v1/chat/completions",
                                       {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 200 and reply["usage"]["completion_tokens"] >= 1
    status, _ = env_server.request("GET", "/v1/models", key="wrong")
    assert status == 401
    log = env_server.log()
    assert "settings from the environment:" in log and "LLAMA_ARG_N_PARALLEL" in log
    assert API_KEY not in log  # names only, never values
    assert "ignoring environment variable LLAMA_ARG_N_CPU_FFN (--n-cpu-ffn)" in log


def test_the_log_file_gets_the_log(env_server: ServerProcess):
    text = (env_server.log_path.parent / "file.log").read_text()
    assert "model loaded:" in text and "settings from the environment:" in text


def _raw_status(url: str) -> tuple[int, str]:
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *a: object, **k: object) -> None:
            return None

    try:
        with urllib.request.build_opener(NoRedirect).open(url, timeout=30) as r:
            return r.status, r.headers.get("Location", "")
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Location", "")


def test_the_prefix_holds_every_route_and_nothing_is_outside_it(env_server: ServerProcess):
    root = env_server.base_url.removesuffix("/llm")
    assert env_server.request("GET", "/health", key=None)[0] == 200
    for path in ("/health", "/v1/models", "/", "/webui/app.js"):
        status, body = ServerProcess(env_server.proc, root, API_KEY, env_server.log_path).request("GET", path)
        assert status == 404, (path, body)
    assert _raw_status(root + "/llm") == (308, "/llm/")
    status, page = env_server.request("GET", "/", key=None)
    assert status == 200 and 'src="webui/app.js"' in page  # relative: resolves under the prefix
    assert env_server.request("GET", "/webui/app.js", key=None)[0] == 200


def test_no_ui(served_model: str, tmp_path: Path):
    srv = start_server(served_model, ["--no-ui", "-t", "1", "-np", "1"], tmp_path / "s.log", None)
    try:
        for path in ("/", "/index.html", "/webui/app.js"):
            assert srv.request("GET", path)[0] == 404, path
        assert srv.request("GET", "/health")[0] == 200
    finally:
        stop_server(srv)


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command is not installed: no certificate to test HTTPS with")
    key, cert = tmp / "key.pem", tmp / "cert.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return key, cert


def test_https(served_model: str, tmp_path: Path):
    key, cert = _self_signed(tmp_path)
    tls = ssl.create_default_context(cafile=str(cert))
    srv = start_server(served_model, ["--ssl-key-file", str(key), "--ssl-cert-file", str(cert), "-t", "1", "-np", "1"],
                       tmp_path / "s.log", None, tls=tls)
    try:
        status, reply = srv.request("POST", "/v1/chat/completions",
                                    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert status == 200 and reply["object"] == "chat.completion"
        assert "listening on https://127.0.0.1:" in srv.log()
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain http gets no http answer
            urllib.request.urlopen(srv.base_url.replace("https", "http") + "/health", timeout=10)
    finally:
        stop_server(srv)


@pytest.mark.parametrize("which", ["only the key", "a bad pair"])
def test_https_files_are_checked_before_the_port_is_bound(served_model: str, tmp_path: Path, which: str, capsys):
    from hybridmoe.cli import main

    if which == "only the key":
        argv, message = ["--ssl-key-file", str(tmp_path / "k.pem")], "--ssl-key-file and --ssl-cert-file go together"
    else:
        (tmp_path / "k.pem").write_text("not a key")
        (tmp_path / "c.pem").write_text("not a certificate")
        argv = ["--ssl-key-file", str(tmp_path / "k.pem"), "--ssl-cert-file", str(tmp_path / "c.pem")]
        message = f"--ssl-cert-file {tmp_path / 'c.pem'} / --ssl-key-file {tmp_path / 'k.pem'}:"
    assert main(["serve", "-m", served_model, "--port", "0", *argv]) == 1
    err = capsys.readouterr().err
    assert f"hybridmoe serve: error: {message}" in err and "listening" not in err


def test_a_model_from_the_hugging_face_cache(served_model: str, tmp_path: Path):
    """`-hf ORG/NAME:TAG` as llama-server users run it, the file already in the cache (here the
    suite's tiny model in the hub's layout): served, and named by its repository."""
    commit = "89abcdef" * 5
    repo_dir = tmp_path / "models--org--tiny-GGUF"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    (repo_dir / "snapshots" / commit).mkdir(parents=True)
    (repo_dir / "snapshots" / commit / "tiny-Q8_0.gguf").symlink_to(served_model)
    srv = start_server(None, ["-hf", "org/tiny-GGUF:Q8_0", "-t", "1", "-np", "1"], tmp_path / "s.log", None,
                       env={"HF_HUB_CACHE": str(tmp_path)})
    try:
        status, models = srv.request("GET", "/v1/models")
        assert status == 200 and models["data"][0]["id"] == "org/tiny-GGUF:Q8_0"
        assert "(from the Hugging Face cache)" in srv.log()
    finally:
        stop_server(srv)


def test_path_serves_another_web_ui(served_model: str, tmp_path: Path):
    """llama-server's --path: the directory's files at / in place of the chat page, open like the
    page; the API keeps its routes and its key."""
    ui = tmp_path / "ui"
    (ui / "assets").mkdir(parents=True)
    (ui / "index.html").write_text("<html>my own ui</html>")
    (ui / "assets" / "app.js").write_text("console.log(1)")
    (tmp_path / "secret.txt").write_text("outside")
    srv = start_server(served_model, ["--path", str(ui), "--api-key", API_KEY, "-t", "1", "-np", "1"],
                       tmp_path / "s.log", API_KEY)
    try:
        page = "<html>my own ui</html>"
        for path, text in (("/", page), ("/index.html", page), ("/assets/app.js", "console.log(1)")):
            status, body = srv.request("GET", path, key=None)
            assert (status, body) == (200, text), path
        assert srv.request("GET", "/webui/app.js")[0] == 404  # the built-in page is not there
        assert srv.request("GET", "/../secret.txt")[0] == 404
        assert srv.request("GET", "/v1/models", key=None)[0] == 401
        assert srv.request("GET", "/v1/models")[0] == 200
        status, reply = srv.request("POST", "/v1/chat/completions",
                                    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert status == 200, reply
    finally:
        stop_server(srv)


def test_path_must_be_a_directory(served_model: str, tmp_path: Path, capsys):
    from hybridmoe.cli import main

    assert main(["serve", "-m", served_model, "--path", str(tmp_path / "nope"), "--port", "0"]) == 1
    assert f"--path {tmp_path / 'nope'}: not a directory" in capsys.readouterr().err
