"""docs/benchmarks.md and README.md's speed table are what bench/report.py makes of bench/results/,
every committed record is well-formed, and every bench script takes --json. No benchmark runs here."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

from hybridmoe.synth import PRESETS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "bench")
sys.path.insert(0, BENCH)

import record  # noqa: E402
import report  # noqa: E402

HELPERS = {"machine.py", "record.py", "report.py"}
SCRIPTS = sorted(f for f in os.listdir(BENCH) if f.endswith(".py") and f not in HELPERS)


def test_benchmarks_md_is_generated_from_the_committed_records():
    records = report.load_records()
    with open(os.path.join(report.RESULTS, "intro.md")) as f:
        expected = report.render_doc(records, f.read())
    with open(report.DOC) as f:
        assert f.read() == expected, "docs/benchmarks.md is stale: run python bench/report.py"


def test_readme_speed_table_is_generated_from_the_committed_records():
    with open(report.README) as f:
        readme = f.read()
    assert readme == report.render_readme(readme, report.load_records()), \
        "README.md's speed table is stale: run python bench/report.py"


def test_report_check_mode_agrees():
    r = subprocess.run([sys.executable, os.path.join(BENCH, "report.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(os.path.join(BENCH, "results")) if f.endswith(".json")))
def test_committed_record_is_well_formed(name):
    with open(os.path.join(BENCH, "results", name)) as f:
        rec = json.load(f)
    assert record.check(rec) == []
    assert name.startswith(rec["bench"] + "-" + rec["date"][:10]), "name records <bench>-<YYYY-MM-DD>-..."
    assert rec["source"].startswith(("emitted by bench/", "transcribed from ")), rec["source"]
    assert rec["rows"], "a record without rows documents nothing"


def test_report_refuses_a_malformed_record(tmp_path):
    (tmp_path / "x-2026-01-01.json").write_text(json.dumps({"schema": 1, "bench": "x"}))
    with pytest.raises(SystemExit, match="missing 'date'"):
        report.load_records(str(tmp_path))


def test_report_formats_ratios_shares_and_missing_values():
    assert report.fmt(None) == "–"
    assert report.fmt(25.6) == "25.6" and report.fmt(25.56) == "25.56" and report.fmt(159.26) == "159.3"
    assert report.fmt(0.8, "hybridmoe / llama.cpp") == "0.8×"
    assert report.fmt(0.453, "default share of read bw") == "45%"
    assert report.fmt(2299) == "2299"


def test_record_round_trip(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [os.path.join(BENCH, "kernels.py"), "--repeats", "1"])
    rec = record.new("kernels", {"repeats": 1})
    rec["rows"] = [{"case": "x", "default": 1.5}]
    path = tmp_path / "out.json"
    record.write(rec, str(path))
    back = json.loads(path.read_text())
    assert record.check(back) == []
    assert back["command"] == "python bench/kernels.py --repeats 1"
    assert back["machine"]["cpu"] and back["machine"]["cpus"] >= 1 and "load_avg_end" in back["machine"]
    assert back["versions"]["hybridmoe"] and back["versions"]["python"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_bench_takes_json_and_prints_the_machine(script):
    """Read from the source, so nothing heavy is imported: --json through record.add_json_arg, and
    the machine line (machine.describe) printed."""
    with open(os.path.join(BENCH, script)) as f:
        tree = ast.parse(f.read())
    calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert "record.add_json_arg" in calls, f"{script} has no --json (record.add_json_arg)"
    assert "record.write" in calls, f"{script} never writes its record"
    assert {"machine.describe", "describe"} & calls, f"{script} does not print the machine line"


def test_no_path_outside_the_repository_is_cited():
    """The session notes directory beside the checkout is not there for users; docs and code
    point into docs/ instead. (The pattern is built so that this file does not match it.)"""
    pattern = "\\.\\./" + "shared"
    r = subprocess.run(["git", "-C", REPO, "grep", "-n", "-I", "-e", pattern], capture_output=True, text=True)
    assert r.stdout == "", r.stdout


def test_vs_llamacpp_finds_llama_bench_beside_llama_server(tmp_path, monkeypatch):
    import vs_llamacpp

    binary = tmp_path / "llama-bench"
    binary.write_text("#!/bin/sh\necho 'version: 9.9.9 (build 1, commit abc)' >&2\n")
    binary.chmod(0o755)
    for var in ("HYBRIDMOE_LLAMA_BENCH", "HYBRIDMOE_LLAMA_SERVER"):
        monkeypatch.delenv(var, raising=False)
    found = vs_llamacpp.find_llamacpp(None, str(tmp_path / "llama-server"))
    assert (found.driver, found.path) == ("llama-bench", str(binary))
    assert "9.9.9" in found.version
    monkeypatch.setenv("HYBRIDMOE_LLAMA_BENCH", str(binary))
    assert vs_llamacpp.find_llamacpp(None, None).path == str(binary)
    with pytest.raises(SystemExit, match="no executable llama-bench"):
        vs_llamacpp.find_llamacpp(str(tmp_path / "missing"), None)


def test_a_bench_run_emits_a_record_the_report_renders(tiny_gguf, tmp_path):
    """decode_breakdown on the tiny model (a few steps of two streams, one mode): the record it writes
    passes the checks, its parts add up to the step, the experts read lie between one token's and two
    tokens' worth, and it becomes a section of the page."""
    out = tmp_path / "decode_breakdown-2026-01-01-test.json"
    r = subprocess.run([sys.executable, os.path.join(BENCH, "decode_breakdown.py"), "-m", tiny_gguf, "-t", "1",
                        "--modes", "exact", "--runs", "1", "--steps", "3", "--ctx", "8", "--streams", "2",
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("cpu: ")
    rec = json.loads(out.read_text())
    assert record.check(rec) == [] and rec["source"] == "emitted by bench/decode_breakdown.py"
    parts = {row["part"]: row for row in rec["rows"]}
    assert parts["MoE experts"]["MB/step"] > 0 and parts["output head"]["GB/s"] > 0
    used = PRESETS["tiny"].config.n_experts_used
    assert used <= parts["experts read per layer"]["ms/step"] <= 2 * used
    assert parts["tok/s"]["ms/step"] == pytest.approx(2 / parts["step"]["ms/step"] * 1e3)
    run = rec["runs"][0]["parts_s"]
    assert sum(v for k, v in run.items() if k != "step") == pytest.approx(run["step"], rel=0.25)
    page = report.render_doc(report.load_records(str(tmp_path)), "# intro")
    assert "## Where a decode step's time goes" in page and "emitted by bench/decode_breakdown.py" in page


def test_vs_llamacpp_summary_takes_every_repetition_and_flags_busy_runs():
    import vs_llamacpp

    def run(tg: list[float], anon: float, busy: bool = False) -> dict:
        return {"samples": {"tg64": tg}, "anon_gib": anon, "busy": busy, "tg_kernel_frac": 0.9,
                "tg_weight_gbs": 20.0, "read_bw_gbs": 40.0}

    results = {"hybridmoe": [run([9.0, 10.0], 1.0), run([11.0, 8.0], 1.2)],
               "llama.cpp": [run([10.0, 12.0], 8.0, busy=True), run([6.0, 10.0], 9.0)]}
    rows, lines = vs_llamacpp.summarize(results, ["hybridmoe", "llama.cpp"])
    tg = next(r for r in rows if r["metric"] == "tg64")
    assert tg["hybridmoe"] == 9.5 and tg["llama.cpp"] == 10.0 and tg["hybridmoe min-max"] == "8.00-11.00"
    assert tg["hybridmoe / llama.cpp"] == pytest.approx(0.95)
    assert tg["hybridmoe / llama.cpp, best"] == pytest.approx(11.0 / 12.0)
    anon = next(r for r in rows if r["metric"] == "anon_gib")
    assert anon["hybridmoe / llama.cpp, best"] == pytest.approx(1.0 / 8.0)  # memory: the lowest is the best
    assert any("BUSY" in ln and "llama.cpp run 0" in ln for ln in lines)
