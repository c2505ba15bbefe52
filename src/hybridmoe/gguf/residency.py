"""Keeping a mapped model resident: read-ahead at load, and mlock (llama.cpp's --mlock).

Expert weights are used in place from the mmap, so how their pages enter the page cache decides
what the first prompt pays:
- The mapping is advised MADV_HUGEPAGE, so pages the kernel reads for it come in 2 MiB folios that
  later processes map with one fault per 2 MiB instead of one per 4 KiB page.
- `prefault` walks the files with MADV_POPULATE_READ (64 MiB calls, sequential, on a background
  thread; ctypes drops the GIL): from a cold cache the file streams in while the first prompt
  computes, and the prompt's own cores take far fewer faults. MADV_WILLNEED is no substitute: one
  call reads at most the device's read-ahead window, in small folios.
- Only what is used from the mapping is walked: with a GPU plan, the tensors it keeps in RAM
  (the rest was copied to the device at load and is never read again).
- A model larger than the available RAM is not walked (it would only evict itself).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any, Callable

log = logging.getLogger("hybridmoe")

MADV_HUGEPAGE = 14
MADV_POPULATE_READ = 22  # Linux 5.14+
_CHUNK = 64 << 20  # populate in pieces so a close() or interpreter exit is never blocked long

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


def _tensor_ranges(model_file: Any, keep: Callable[[str], bool]) -> list[tuple[int, int]]:
    """(address, length) spans of the mapped tensors `keep` selects, adjacent ones merged."""
    spans = []
    for name, info in model_file.tensors.items():
        r = model_file.files[info.file_index].mapped_range()
        if r is not None and info.nbytes and keep(name):
            spans.append((r[0] + info.offset, info.nbytes))
    merged: list[tuple[int, int]] = []
    for addr, n in sorted(spans):
        if merged and addr <= merged[-1][0] + merged[-1][1]:
            a0, n0 = merged[-1]
            merged[-1] = (a0, max(n0, addr + n - a0))
        else:
            merged.append((addr, n))
    return merged


def prefer_huge_folios(model_file: Any) -> None:
    """MADV_HUGEPAGE on the mappings (a no-op where THP is off or unsupported)."""
    for addr, length in _ranges(model_file):
        _advise(addr, length, MADV_HUGEPAGE)


def _populate(ranges: list[tuple[int, int]]) -> None:
    for addr, length in ranges:
        for off in range(0, length, _CHUNK):
            if not _advise(addr + off, min(_CHUNK, length - off), MADV_POPULATE_READ):
                log.debug("MADV_POPULATE_READ failed (errno %d); no read-ahead", ctypes.get_errno())
                return  # kernel < 5.14: the first prompt faults its pages in itself
    _report_small_folios(ranges)


def pmd_mapped(smaps: str, ranges: list[tuple[int, int]]) -> tuple[int, int]:
    """(bytes mapped in 2 MiB pages, resident bytes) of the mappings in /proc/self/smaps text that
    overlap `ranges`."""
    pmd = rss = 0
    hit = False
    for line in smaps.splitlines():
        head = line.split(None, 1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, _, hi = head.partition("-")
            try:
                a, b = int(lo, 16), int(hi, 16)
            except ValueError:
                continue
            hit = any(a < addr + n and addr < b for addr, n in ranges)
        elif hit and head in ("Rss:", "FilePmdMapped:"):
            kib = int(line.split()[1]) * 1024
            if head == "Rss:":
                rss += kib
            else:
                pmd += kib
    return pmd, rss


def _report_small_folios(ranges: list[tuple[int, int]]) -> None:
    """Says so when most of the model is mapped in 4 KiB pages although huge folios were asked
    for: its pages were already cached in small folios (another program read or copied the file),
    and the experts then stream ~7% slower (bench/decode_breakdown.py, docs/benchmarks.md)."""
    try:
        with open("/proc/self/smaps") as f:
            pmd, rss = pmd_mapped(f.read(), ranges)
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp_on = "[never]" not in f.read()
    except OSError:
        return
    if thp_on and rss >= 1 << 30 and pmd < rss // 2:
        log.info("model file: %.1f of %.1f GiB mapped in 2 MiB pages; the page cache holds the rest in small "
                 "pieces (the file was read or copied by another program). Decode reads it faster once it is "
                 "read in again through this mapping: drop it from the page cache (`dd if=FILE iflag=nocache "
                 "count=0`, or `echo 1 > /proc/sys/vm/drop_caches`) while no process maps it, then start again.",
                 pmd / 2**30, rss / 2**30)


def available_ram_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (includes reclaimable page cache), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    return None


def prefault(model_file: Any, background: bool = True,
             keep: Callable[[str], bool] | None = None) -> threading.Thread | None:
    """Advise huge folios and read the model's files (or only the tensors `keep` selects) into
    the page cache, mapping every page; returns the thread when backgrounded (None when run
    inline or skipped)."""
    prefer_huge_folios(model_file)
    ranges = _ranges(model_file) if keep is None else _tensor_ranges(model_file, keep)
    have = available_ram_bytes()
    if have is not None and sum(n for _, n in ranges) > have:
        return None
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
