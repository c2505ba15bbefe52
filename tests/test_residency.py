"""Background prefault and mlock of the mapped model file."""

from __future__ import annotations

import numpy as np
import pytest

from hybridmoe.gguf import residency
from hybridmoe.gguf.reader import open_model


def _resident_fraction(mm: np.ndarray) -> float:
    import ctypes
    import mmap

    addr, length = mm.__array_interface__["data"][0], mm.size
    page = mmap.PAGESIZE
    start = addr - addr % page
    n = (length + addr - start + page - 1) // page
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, n * page, vec) == 0
    return sum(b & 1 for b in vec) / n


@pytest.mark.parametrize("populate", [False, True])
def test_prefault_maps_the_file_and_leaves_data_intact(tiny_gguf, populate):
    mf = open_model(tiny_gguf)
    before = {name: np.array(mf.raw(name)) for name in list(mf.tensors)[:5]}
    t = residency.prefault(mf, background=True, populate=populate)
    assert t is not None
    t.join(timeout=60)
    assert not t.is_alive()
    assert _resident_fraction(mf.files[0]._mm) == 1.0
    for name, data in before.items():
        np.testing.assert_array_equal(mf.raw(name), data)


def test_mlock_pins_or_says_why(tiny_gguf, caplog):
    mf = open_model(tiny_gguf)
    ok = residency.mlock(mf)
    # Root in CI may lock; an unprivileged user with a small RLIMIT_MEMLOCK gets a warning instead.
    assert ok or "mlock" in caplog.text
