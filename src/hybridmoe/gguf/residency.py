"""Keeping a mapped model resident: background prefault, and mlock (llama.cpp's --mlock).

Expert weights are used in place from the mmap. The first pass over them otherwise takes a
page fault per 4 KiB page (minor when the file is in the page cache, a disk read when not),
which made the first prompt after load ~1.5x slower than later ones. `prefault` asks the
kernel to read ahead (MADV_WILLNEED) and to map every page (MADV_POPULATE_READ, Linux 5.14+)
on a background thread; ctypes releases the GIL for the syscall, so loading goes on meanwhile.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

log = logging.getLogger("hybridmoe")

MADV_WILLNEED = 3
MADV_POPULATE_READ = 22
_CHUNK = 256 << 20  # advise in pieces so a close() or interpreter exit is never blocked long

_libc: Any = None


def _lib() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return _libc


def _ranges(model_file: Any) -> list[tuple[int, int]]:
    out = []
    for f in model_file.files:
        r = f.mapped_range()
        if r is not None:
            out.append(r)
    return out


def _advise(addr: int, length: int, advice: int) -> bool:
    page = 4096
    start = addr - addr % page  # madvise wants a page-aligned start
    return _lib().madvise(start, length + (addr - start), advice) == 0


def _populate(ranges: list[tuple[int, int]]) -> None:
    for addr, length in ranges:
        _advise(addr, length, MADV_WILLNEED)
    for addr, length in ranges:
        for off in range(0, length, _CHUNK):
            if not _advise(addr + off, min(_CHUNK, length - off), MADV_POPULATE_READ):
                return  # older kernel: WILLNEED's read-ahead is what we get


def prefault(model_file: Any, background: bool = True) -> threading.Thread | None:
    """Read ahead and map every page of the model's files; returns the thread when backgrounded."""
    ranges = _ranges(model_file)
    if not background:
        _populate(ranges)
        return None
    t = threading.Thread(target=_populate, args=(ranges,), name="hybridmoe-prefault", daemon=True)
    t.start()
    return t


def mlock(model_file: Any) -> bool:
    """Pin the mapped files in RAM (never paged out). Needs RLIMIT_MEMLOCK or CAP_IPC_LOCK;
    on failure logs why and returns False (the model still runs, unpinned)."""
    ok = True
    for addr, length in _ranges(model_file):
        if _lib().mlock(addr, length) != 0:
            err = ctypes.get_errno()
            log.warning("--mlock: mlock of %.1f GiB failed (errno %d: %s); raise `ulimit -l` or run "
                        "with CAP_IPC_LOCK", length / 2**30, err, __import__("os").strerror(err))
            ok = False
    return ok
