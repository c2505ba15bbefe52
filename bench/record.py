"""The JSON record every bench writes with `--json PATH` (`-` for stdout): one run, self-describing.

    {"schema": 1, "bench": "kernels", "date": "2026-12-03T06:25Z", "command": "python bench/kernels.py ...",
     "source": "emitted by bench/kernels.py", "machine": {cpu, isa, cpus, ram_gib, load_avg, os},
     "versions": {"hybridmoe": git rev, "python", "torch", ...; "llama.cpp" when one ran},
     "params": {...}, "rows": [{column: value}, ...], "runs": [...], "notes": ""}

`rows` are what the bench's table shows (medians where it repeats); `runs` the per-run figures
behind them. `bench/results/*.json` are such records; `bench/report.py` writes
docs/benchmarks.md from them. A record typed in from an older run says so in `source`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys

import machine

SCHEMA = 1
REQUIRED = ("schema", "bench", "date", "command", "source", "machine", "versions", "params", "rows", "runs")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def add_json_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--json", metavar="PATH", default=None,
                    help="also write this run's record (see bench/record.py) to PATH; '-' prints it to stdout")


def git_rev() -> str:
    """Short commit of the checkout the bench ran from, '+dirty' with uncommitted changes."""
    try:
        rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (rev or "unknown") + ("+dirty" if dirty else "")


def versions() -> dict:
    out = {"hybridmoe": git_rev(), "python": platform.python_version()}
    for pkg in ("torch", "numpy"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def command_line() -> str:
    script = os.path.relpath(os.path.abspath(sys.argv[0]), REPO)
    return shlex.join(["python", script, *sys.argv[1:]])


def new(bench: str, params: dict) -> dict:
    """A record for a run starting now (the machine's load average is taken now)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return {"schema": SCHEMA, "bench": bench, "date": now.strftime("%Y-%m-%dT%H:%MZ"), "command": command_line(),
            "source": f"emitted by bench/{bench}.py", "machine": machine.info(), "versions": versions(),
            "params": params, "rows": [], "runs": [], "notes": ""}


def write(record: dict, path: str | None) -> None:
    """Writes the record to `path` ('-': stdout; None: nothing), with the load average at the end."""
    if path is None:
        return
    record["machine"]["load_avg_end"] = machine.load_average()
    text = json.dumps(record, indent=1, ensure_ascii=False) + "\n"
    if path == "-":
        sys.stdout.write(text)
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    print(f"record written to {path}")


def check(record: dict) -> list[str]:
    """Problems that make a record unusable for the report (empty list: fine)."""
    problems = [f"missing {k!r}" for k in REQUIRED if k not in record]
    if record.get("schema") != SCHEMA:
        problems.append(f"schema {record.get('schema')!r}, expected {SCHEMA}")
    if not isinstance(record.get("rows"), list) or not all(isinstance(r, dict) for r in record.get("rows", [])):
        problems.append("rows must be a list of objects")
    if "cpu" not in record.get("machine", {}):
        problems.append("machine.cpu missing")
    return problems
