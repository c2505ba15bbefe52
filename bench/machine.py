"""The machine line every bench prints: CPU model, the SIMD flags the kernels care about, cores."""

from __future__ import annotations

import os

_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi", "avx512_bf16",
          "avx_vnni")


def describe() -> str:
    """'cpu: <model>; isa flags: ...; cpus: N' from /proc/cpuinfo (what Linux reports)."""
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
    have = [f for f in _FLAGS if f in flags]
    return f"cpu: {model}; isa flags: {' '.join(have) or 'none of ' + ','.join(_FLAGS)}; cpus: {len(os.sched_getaffinity(0))}"
