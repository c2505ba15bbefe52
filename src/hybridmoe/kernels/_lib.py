"""ctypes loader for the compiled kernel library (csrc/, built by setup.py as `_hmk*.so`), loaded
once at import (LIB, or None and WHY_MISSING), and the block types it multiplies.

Function pointers are bound once with argtypes; hot calls pass plain ints (no ndarray.ctypes).
The library is plain C++ with a C ABI: no Python or torch headers, so no ABI coupling.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os

from hybridmoe.gguf.constants import BLOCK_SIZES, GGMLType

log = logging.getLogger(__name__)

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int
_F = ctypes.c_float

ERR_BAD_ARG, ERR_BAD_EXPERT, ERR_BAD_ISA = -1, -2, -3

# MXFP4 and Q8_0 have kernels of their own in every activation mode; the other block types the C
# library reads (EXT_TYPES) are decoded to float32 rows and multiplied in fp32 in every mode.
NATIVE_TYPES = (GGMLType.MXFP4, GGMLType.Q8_0)
EXT_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.IQ4_NL, GGMLType.IQ4_XS,
             GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)
KERNEL_TYPES = NATIVE_TYPES + EXT_TYPES  # block types the C kernels multiply
BLOCK_BYTES = {t: BLOCK_SIZES[t][1] for t in KERNEL_TYPES}

_SIGNATURES = {
    "hm_abi_version": ([], _I32),
    "hm_isa_supported": ([ctypes.c_char_p], _I32),
    "hm_set_isa": ([ctypes.c_char_p], _I32),
    "hm_get_isa": ([], ctypes.c_char_p),
    "hm_set_num_threads": ([_I32], _I32),
    "hm_get_num_threads": ([], _I32),
    "hm_set_gemv_max_tokens": ([_I32, _I32], _I32),
    "hm_get_gemv_max_tokens": ([_I32], _I32),
    "hm_set_q8_gemv_max_tokens": ([_I32], _I32),
    "hm_get_q8_gemv_max_tokens": ([], _I32),
    "hm_quantize_q16": ([_P, _I64, _P, _P], _I64),
    "hm_quantize_d3": ([_P, _I64, _P], _I64),
    "hm_d3_active": ([], _I32),
    "hm_dequant": ([_I32, _P, _I64, _I64, _I64, _P], _I32),
    "hm_linear": ([_I32, _P, _I64, _I64, _P, _I64, _I64, _P, _P, _I32], _I32),
    "hm_linear_multi": ([_I32, _P, _I64, _I64, _I32, _P, _P, _P, _P, _P, _P, _I32], _I32),
    "hm_rms_norm": ([_P, _I64, _I64, _P, _F, _P], _I32),
    "hm_read_probe": ([_P, _I64], ctypes.c_uint64),
    "hm_quantize_q8": ([_P, _I64, _P, _P], _I64),
    "hm_swiglu": ([_P, _P, _I64, _I64, _P, _P, _F, _F, _P, _I64], _I32),
    "hm_attn_decode": ([_P, _P, _P, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _I64, _P, _I64, _I64, _I64, _P,
                        _F, _P], _I32),
    "hm_moe_forward": ([_P, _I64, _I64, _P, _P, _I64, _I64, _I64, _I32, _I32, _P, _I64, _P, _I64, _P, _I64,
                        _P, _P, _P, _F, _F, _P, _I32], _I32),
    "hm_moe_block": ([_P, _I64, _I64, _P, _F, _P, _P, _I64, _I64, _I64, _I32, _I32, _P, _I64, _P, _I64, _P, _I64,
                      _P, _P, _P, _F, _F, _P, _I32, _P, _P], _I32),
}
ABI_VERSION = 11


def _find_library() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_hmk*.so")))
    return found[0] if found else None


def load() -> tuple[ctypes.CDLL | None, str]:
    """Returns (library, "") or (None, reason). HYBRIDMOE_NO_KERNELS=1 disables the library."""
    if os.environ.get("HYBRIDMOE_NO_KERNELS", "") not in ("", "0"):
        return None, "disabled by HYBRIDMOE_NO_KERNELS"
    path = _find_library()
    if path is None:
        return None, "compiled library _hmk*.so not found (reinstall with a C++ compiler: pip install -e .)"
    try:
        lib = ctypes.CDLL(path)
        for name, (args, res) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
    except (OSError, AttributeError) as exc:
        return None, f"cannot load {path}: {exc}"
    if lib.hm_abi_version() != ABI_VERSION:
        return None, f"{path} has ABI {lib.hm_abi_version()}, expected {ABI_VERSION} (rebuild it)"
    return lib, ""


LIB, WHY_MISSING = load()
