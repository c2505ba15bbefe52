"""The kernels' process-wide tuning: the worker pool's size and the token count at which the
streaming GEMV hands over to the tiled GEMM (per weight format; fast math has its own)."""

from __future__ import annotations

import os

import torch

from hybridmoe.gguf.constants import GGMLType
from hybridmoe.kernels._lib import LIB, NATIVE_TYPES


def set_num_threads(n: int) -> None:
    """Resize the kernels' persistent worker pool (the caller counts as one of the n threads)."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"num_threads must be a positive int, got {n!r}")
    if LIB is not None and LIB.hm_set_num_threads(n):
        raise RuntimeError(f"hm_set_num_threads({n}) failed")


def num_threads() -> int:
    return LIB.hm_get_num_threads() if LIB else torch.get_num_threads()


def set_gemv_max_tokens(n: int | None, *, fast_math: bool = False, ggml_type: GGMLType | None = None) -> None:
    """Tokens per expert (or per dense call) up to which the streaming GEMV is used; above it,
    rows are decoded to an L2-sized float32 tile and multiplied by a register-blocked GEMM.
    The fp32 crossover is per weight format, measured per kernel set (MXFP4: 48 on AVX-512,
    whose GEMV folds the block scale into the LUT, 14 on AVX2; Q8_0: 16); ggml_type= sets one
    format's, None both. fast_math=True sets fast mode's own crossover instead (one for both
    formats): its int8 tile GEMM overtakes the int8 GEMV from a few tokens (default 2).
    n=None restores the default."""
    if n is not None and (not isinstance(n, int) or n < 0):
        raise ValueError(f"gemv_max_tokens must be an int >= 0 or None, got {n!r}")
    if ggml_type is not None and (fast_math or ggml_type not in NATIVE_TYPES):
        raise ValueError(f"ggml_type= names an fp32 crossover of MXFP4 or Q8_0, got {ggml_type!r}"
                         f"{' with fast_math=True' if fast_math else ''}")
    if LIB is None:
        return
    c_n = -1 if n is None else n
    if fast_math:
        LIB.hm_set_q8_gemv_max_tokens(c_n)
    else:
        LIB.hm_set_gemv_max_tokens(0 if ggml_type is None else int(ggml_type), c_n)


def gemv_max_tokens(ggml_type: GGMLType, *, fast_math: bool = False) -> int:
    """The crossover set_gemv_max_tokens sets, for one weight format (0 without the library)."""
    if ggml_type not in NATIVE_TYPES:
        raise ValueError(f"ggml_type must be MXFP4 or Q8_0, got {ggml_type!r}")
    if LIB is None:
        return 0
    if fast_math:
        return int(LIB.hm_get_q8_gemv_max_tokens())
    return int(LIB.hm_get_gemv_max_tokens(int(ggml_type)))


def physical_cores() -> int:
    cpus = len(os.sched_getaffinity(0))
    try:
        with open("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list") as f:
            siblings = f.read().strip()
        per_core = sum(1 + (int(b) - int(a) if "-" in part else 0)
                       for part in siblings.split(",") for a, _, b in [part.partition("-")])
        return max(1, cpus // max(1, per_core))
    except (OSError, ValueError):
        return cpus
