"""The machine a bench ran on: CPU model, the SIMD flags the kernels care about, cores, RAM, load.

`describe()` is the line every bench prints first; `info()` is the same as a dict for its JSON record.
"""

from __future__ import annotations

import os
import platform

ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi", "avx512_bf16",
             "avx_vnni")


def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key.strip() == "model name" and model == "unknown":
                    model = val.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(val.split())
    except OSError:
        pass
    return model, flags


def _ram_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages: how busy the machine was (timings on a busy one are slower)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def info() -> dict:
    """CPU model, ISA flags (those of ISA_FLAGS present), usable CPUs, RAM, load average, OS."""
    model, flags = _cpuinfo()
    return {"cpu": model, "isa": [f for f in ISA_FLAGS if f in flags], "cpus": len(os.sched_getaffinity(0)),
            "ram_gib": _ram_gib(), "load_avg": load_average(), "os": f"{platform.system()} {platform.release()}"}


def describe() -> str:
    """'cpu: <model>; isa flags: ...; cpus: N; ram: G GiB; load: a b c' for the top of a bench's output."""
    m = info()
    isa = " ".join(m["isa"]) or "none of " + ",".join(ISA_FLAGS)
    load = " ".join(str(x) for x in m["load_avg"]) or "unknown"
    return f"cpu: {m['cpu']}; isa flags: {isa}; cpus: {m['cpus']}; ram: {m['ram_gib']} GiB; load average: {load}"


def read_bandwidth(threads: int, gib: float = 2.0, repeats: int = 3) -> tuple[float, str]:
    """GB/s of the kernel library's read loop on its pool over a touched buffer (median of
    `repeats`), or of a one-thread numpy sum without the library: the ceiling a weight stream
    can reach on this machine right now."""
    import time

    import numpy as np

    from hybridmoe import kernels as K
    from hybridmoe.kernels._lib import LIB

    buf = np.ones(int(gib * 2**30) // 8, dtype=np.float64)
    if K.available():
        K.set_num_threads(threads)
        addr = buf.__array_interface__["data"][0]
        run, how = (lambda: LIB.hm_read_probe(addr, buf.nbytes)), "C read loop"
    else:
        run, how = (lambda: float(buf.sum())), "numpy sum, 1 thread"
    run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return buf.nbytes / sorted(times)[len(times) // 2] / 1e9, how
