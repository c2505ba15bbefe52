"""CPU sets for replicas on one host (`hybridmoe replicas --pin`): whole physical cores, one NUMA
node's cores kept together, so two replicas never share a core or spread over two nodes' caches.

Read from Linux's sysfs; where it is missing (containers, other systems) every allowed CPU counts
as its own core on node 0.
"""

from __future__ import annotations

import os
from pathlib import Path

SYS_CPU = Path("/sys/devices/system/cpu")
SYS_NODE = Path("/sys/devices/system/node")


def parse_cpu_list(text: str) -> list[int]:
    """sysfs's "0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def _read_int(path: Path, default: int) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return default


def node_of_cpus(cpus: list[int], sys_node: Path = SYS_NODE) -> dict[int, int]:
    """cpu -> NUMA node (0 where sysfs names none)."""
    node = dict.fromkeys(cpus, 0)
    for d in sorted(sys_node.glob("node[0-9]*")):
        try:
            members = parse_cpu_list((d / "cpulist").read_text())
        except OSError:
            continue
        for c in members:
            if c in node:
                node[c] = int(d.name[4:])
    return node


def physical_cores(cpus: list[int], sys_cpu: Path = SYS_CPU, sys_node: Path = SYS_NODE) -> list[tuple[int, list[int]]]:
    """(node, its SMT siblings among `cpus`) per physical core, ordered by node, then core."""
    node = node_of_cpus(cpus, sys_node)
    cores: dict[tuple[int, int, int], list[int]] = {}
    for c in sorted(cpus):
        topo = sys_cpu / f"cpu{c}" / "topology"
        key = (node[c], _read_int(topo / "physical_package_id", 0), _read_int(topo / "core_id", c))
        cores.setdefault(key, []).append(c)
    return [(key[0], members) for key, members in sorted(cores.items())]


def _split(items: list[list[int]], n: int) -> list[list[list[int]]]:
    """`items` in n contiguous runs whose lengths differ by at most one."""
    base, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def replica_cpu_sets(n: int, mode: str, cores: list[tuple[int, list[int]]] | None = None) -> list[list[int]]:
    """One CPU list per replica. mode "cores": the cores, in node order, split in n contiguous runs
    (a run spans two nodes only where the counts do not divide); "numa": replica i on node i mod
    nodes, a node's cores split among its replicas. ValueError when there are fewer cores than replicas to give each one."""
    if cores is None:
        cores = physical_cores(sorted(os.sched_getaffinity(0)))
    if mode == "cores":
        if len(cores) < n:
            raise ValueError(f"--pin cores: {n} replicas need at least {n} physical cores, this process may use "
                             f"{len(cores)} (use --pin none, or fewer replicas)")
        return [[c for _, members in run for c in members] for run in _split(cores, n)]
    if mode != "numa":
        raise ValueError(f"unknown --pin mode {mode!r}")
    nodes = sorted({node for node, _ in cores})
    per_node = {node: [m for nd, m in cores if nd == node] for node in nodes}
    users = {node: [i for i in range(n) if nodes[i % len(nodes)] == node] for node in nodes}
    sets: list[list[int]] = [[] for _ in range(n)]
    for node in nodes:
        if len(per_node[node]) < len(users[node]):
            raise ValueError(f"--pin numa: node {node} has {len(per_node[node])} cores for "
                             f"{len(users[node])} replicas")
        for i, run in zip(users[node], _split(per_node[node], len(users[node]) or 1)):
            sets[i] = [c for members in run for c in members]
    return sets


def count_cores(cpus: list[int], cores: list[tuple[int, list[int]]]) -> int:
    """Physical cores among `cpus` (the threads a replica pinned to them should run)."""
    chosen = set(cpus)
    return sum(1 for _, members in cores if chosen & set(members))


def format_cpus(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (as taskset and sysfs write them)."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
