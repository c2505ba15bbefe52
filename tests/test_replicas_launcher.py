"""`hybridmoe replicas` without starting anything: CPU sets from a fake sysfs, the replicas' and the
gateway's command lines, and the serve flags the launcher refuses to pass through."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from hybridmoe.commands import replicas
from hybridmoe.commands.cpu_sets import format_cpus, parse_cpu_list, physical_cores, replica_cpu_sets

# Two nodes of four cores, two SMT threads each: cpu c and c + 8 are siblings, node 1 has cores 4-7.
TWO_NODES = [(c // 4, [c, c + 8]) for c in range(8)]


def fake_sysfs(root: Path) -> tuple[Path, Path]:
    cpu, node = root / "cpu", root / "node"
    for c in range(16):
        topo = cpu / f"cpu{c}" / "topology"
        topo.mkdir(parents=True)
        (topo / "core_id").write_text(f"{c % 8}\n")
        (topo / "physical_package_id").write_text("0\n")
    for n, cpus in ((0, "0-3,8-11"), (1, "4-7,12-15")):
        (node / f"node{n}").mkdir(parents=True)
        (node / f"node{n}" / "cpulist").write_text(cpus + "\n")
    return cpu, node


def test_physical_cores_keep_siblings_and_nodes_together(tmp_path):
    cpu, node = fake_sysfs(tmp_path)
    assert physical_cores(list(range(16)), cpu, node) == TWO_NODES
    assert physical_cores([0, 1], tmp_path / "none", tmp_path / "none") == [(0, [0]), (0, [1])]  # no sysfs
    assert parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11] and format_cpus([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_replica_cpu_sets():
    assert replica_cpu_sets(2, "cores", TWO_NODES) == [[0, 8, 1, 9, 2, 10, 3, 11], [4, 12, 5, 13, 6, 14, 7, 15]]
    four = replica_cpu_sets(4, "numa", TWO_NODES)  # replicas 0 and 2 on node 0, 1 and 3 on node 1
    assert four == [[0, 8, 1, 9], [4, 12, 5, 13], [2, 10, 3, 11], [6, 14, 7, 15]]
    with pytest.raises(ValueError, match="at least 9 physical cores"):
        replica_cpu_sets(9, "cores", TWO_NODES)


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    replicas.add_parser(p.add_subparsers())
    return p.parse_args(["replicas", *argv])


def test_command_lines(monkeypatch):
    monkeypatch.setattr(replicas, "physical_cores", lambda cpus: TWO_NODES)
    monkeypatch.setattr(replicas, "gateway_command", lambda: ["smg", "launch"])
    args = parse("-n", "2", "--port", "9000", "--prompt-cache-dir", "/c", "--worker-url", "http://b:8081",
                 "--gateway-arg=--cache-threshold=0.5", "--", "-m", "m.gguf", "--api-key", "k1,k2")
    serve_args = replicas.check_serve_args(args.serve_args)
    r0, r1, gw = replicas.plan_children(args, serve_args, "/r")
    assert r0.url == "http://127.0.0.1:9001" and r1.url == "http://127.0.0.1:9002"
    assert r0.cmd[3:] == ["serve", "-m", "m.gguf", "--api-key", "k1,k2", "--host", "127.0.0.1", "--port", "9001",
                          "--alias", "gpt-oss", "--responses-dir", "/r", "-t", "4",
                          "--prompt-cache-dir", str(Path("/c") / "replica-0")]
    assert r1.cmd[-2:] == ["--prompt-cache-dir", str(Path("/c") / "replica-1")] and r1.cpus == [4, 12, 5, 13, 6, 14, 7, 15]
    assert gw.cmd[:2] == ["smg", "launch"] and gw.cmd[-1] == "--cache-threshold=0.5"
    i = gw.cmd.index("--worker-urls")
    assert gw.cmd[i + 1:i + 4] == [r0.url, r1.url, "http://b:8081"] and "k1" in gw.cmd and "k2" not in gw.cmd
    assert gw.cmd[gw.cmd.index("--policy") + 1] == "cache_aware"
    args = parse("--pin", "none", "--", "-t", "3")  # threads given: kept; no pinning
    r0 = replicas.plan_children(args, replicas.check_serve_args(args.serve_args), "/r")[0]
    assert r0.cpus is None and r0.cmd.count("-t") == 1


def test_the_gateway_gets_the_first_key(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("\n kf1 \nkf2\n")
    assert replicas.first_api_key(["--api-key", "k1,k2"]) == "k1"
    assert replicas.first_api_key(["--api-key-file", str(keys)]) == "kf1"
    assert replicas.first_api_key(["-m", "m.gguf"]) is None


@pytest.mark.parametrize("flag", ["--port", "--host=0.0.0.0", "-a", "--prompt-cache-dir"])
def test_flags_set_per_replica_are_refused_after_the_separator(flag):
    with pytest.raises(ValueError, match="set per replica"):
        replicas.check_serve_args(["--", "-m", "m.gguf", flag, "x"])


def test_no_gateway_without_smg(monkeypatch):
    monkeypatch.setattr(replicas, "gateway_command", lambda: None)
    with pytest.raises(ValueError, match="pip install smg"):
        replicas.plan_children(parse("--pin", "none"), [], "/r")
    assert [c.name for c in replicas.plan_children(parse("--pin", "none", "--no-gateway"), [], "/r")] == [
        "replica-0", "replica-1"]
