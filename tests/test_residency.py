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


def test_prefault_maps_the_file_and_leaves_data_intact(tiny_gguf):
    mf = open_model(tiny_gguf)
    before = {name: np.array(mf.raw(name)) for name in list(mf.tensors)[:5]}
    t = residency.prefault(mf, background=True)
    assert t is not None
    t.join(timeout=60)
    assert not t.is_alive()
    assert _resident_fraction(mf.files[0]._mm) == 1.0
    for name, data in before.items():
        np.testing.assert_array_equal(mf.raw(name), data)


class _Mapped:
    """The one method of a model file's mapping that residency uses."""

    def __init__(self, mm: np.memmap):
        self._mm = mm

    def mapped_range(self) -> tuple[int, int]:
        return self._mm.__array_interface__["data"][0], int(self._mm.size)


class _Files:
    def __init__(self, mm: np.memmap):
        self.files = [_Mapped(mm)]


def _evicted_file(tmp_path, mib: int = 48) -> np.memmap:
    """A file written, synced and dropped from the page cache (skips where that cannot be done,
    e.g. on tmpfs, since a cached file would let the read-ahead test pass without reading)."""
    import os

    path = tmp_path / "weights.bin"
    data = np.random.default_rng(0).integers(0, 256, mib << 20, dtype=np.uint8)
    with open(path, "wb") as f:
        f.write(data.tobytes())
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    if _resident_fraction(mm) > 0.5:
        pytest.skip("this filesystem keeps the file cached after POSIX_FADV_DONTNEED")
    return mm


def test_prefault_reads_a_cold_file_whole(tmp_path):
    """48 MiB, several times a read-ahead window: one MADV_WILLNEED over the mapping would read
    one window (what the loader did before); the populate walk must bring in every page."""
    mm = _evicted_file(tmp_path)
    assert residency.prefault(_Files(mm), background=False) is None
    assert _resident_fraction(mm) == 1.0


def test_prefault_skips_a_model_larger_than_ram(tmp_path, monkeypatch):
    mm = _evicted_file(tmp_path)
    monkeypatch.setattr(residency, "available_ram_bytes", lambda: 16 << 20)
    assert residency.prefault(_Files(mm), background=True) is None
    assert _resident_fraction(mm) < 0.5


def test_mlock_pins_or_says_why(tiny_gguf, caplog):
    mf = open_model(tiny_gguf)
    ok = residency.mlock(mf)
    # Root in CI may lock; an unprivileged user with a small RLIMIT_MEMLOCK gets a warning instead.
    assert ok or "mlock" in caplog.text


def test_tensor_ranges_cover_exactly_the_kept_tensors(tiny_gguf):
    """A GPU plan walks only the tensors it keeps in RAM: every kept tensor lies inside one
    merged span, and no span reaches into a tensor that is not kept."""
    mf = open_model(tiny_gguf)
    base = mf.files[0].mapped_range()[0]
    names = sorted(mf.tensors, key=lambda n: mf.info(n).offset)
    kept = {n for i, n in enumerate(names) if "ffn" in n or i % 3 == 0}
    spans = residency._tensor_ranges(mf, lambda n: n in kept)
    assert len(spans) < len(kept)  # neighbours merged
    for n in names:
        info = mf.info(n)
        lo, hi = base + info.offset, base + info.offset + info.nbytes
        inside = [a <= lo and hi <= a + m for a, m in spans]
        overlap = [lo < a + m and a < hi for a, m in spans]
        if n in kept:
            assert sum(inside) == 1, n
        else:
            assert not any(overlap), n
    everything = residency._tensor_ranges(mf, lambda n: True)
    first, last = mf.info(names[0]), mf.info(names[-1])
    assert everything == [(base + first.offset, last.offset + last.nbytes - first.offset)]


SMAPS = """\
7f0000000000-7f0040000000 r--s 00000000 fe:01 123  /models/m.gguf
Size:            1048576 kB
Rss:             1048576 kB
FilePmdMapped:    262144 kB
7f0040000000-7f0040200000 rw-p 00000000 00:00 0
Rss:                2048 kB
FilePmdMapped:         0 kB
7f0050000000-7f0060000000 r--s 00000000 fe:01 124  /models/other.gguf
Rss:              262144 kB
FilePmdMapped:    262144 kB
"""


def test_pmd_mapped_counts_only_the_model_mappings():
    model = [(0x7F0000000000 + 4096, 0x40000000 - 4096)]
    assert residency.pmd_mapped(SMAPS, model) == (256 << 20, 1 << 30)
    assert residency.pmd_mapped(SMAPS, [(0x7F0070000000, 4096)]) == (0, 0)


@pytest.mark.parametrize("thp,logged", [("always [madvise] never", True), ("always madvise [never]", False)])
def test_small_folios_get_one_hint_where_huge_pages_are_on(monkeypatch, caplog, thp, logged):
    import io

    files = {"/proc/self/smaps": SMAPS, "/sys/kernel/mm/transparent_hugepage/enabled": thp}
    monkeypatch.setattr(residency, "open", lambda path, *a, **k: io.StringIO(files[path]), raising=False)
    with caplog.at_level("INFO", logger="hybridmoe"):
        residency._report_small_folios([(0x7F0000000000, 0x40000000)])
    assert ("0.2 of 1.0 GiB mapped in 2 MiB pages" in caplog.text) == logged
