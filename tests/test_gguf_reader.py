"""Our GGUF reader: cross-checked against gguf.GGUFReader, split models, and every bad-file error."""

from __future__ import annotations

import logging
import os
import struct

import gguf
import numpy as np
import pytest

from hybridmoe.gguf import GGMLType, GGUFError, TensorSpec, open_model, write_gguf, write_split
from hybridmoe.gguf.constants import GGUFValueType

GQT = gguf.GGMLQuantizationType


def _write_with_gguf_py(path, rng):
    """A file made by the reference writer: every scalar value type plus typical tensors."""
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -3)
    w.add_uint16("t.u16", 65535)
    w.add_int16("t.i16", -2)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -7)
    w.add_uint64("t.u64", 2**40)
    w.add_int64("t.i64", -(2**40))
    w.add_float32("t.f32", 0.25)
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo 🙂")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.strs", ["a", "", "ü" * 300, "x"])
    w.add_array("t.floats", [0.5, -1.25])
    tensors = {
        "f32": rng.standard_normal((3, 32)).astype(np.float32),
        "f16": rng.standard_normal((2, 3, 32)).astype(np.float16),
    }
    for name, a in tensors.items():
        w.add_tensor(name, a)
    raws = {
        "bf16": (rng.integers(0, 256, (4, 64), dtype=np.uint8), GQT.BF16),
        "q8": (rng.integers(0, 256, (4, 2 * 34), dtype=np.uint8), GQT.Q8_0),
        "mx": (rng.integers(0, 256, (2, 4, 3 * 17), dtype=np.uint8), GQT.MXFP4),
    }
    for name, (a, t) in raws.items():
        w.add_tensor(name, a, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors, {k: v[0] for k, v in raws.items()}


def test_reads_gguf_py_file_like_gguf_py(tmp_path):
    path = tmp_path / "ref.gguf"
    typed, raws = _write_with_gguf_py(path, np.random.default_rng(1))
    ref = gguf.GGUFReader(str(path))
    with open_model(path) as m:
        for key, field in ref.fields.items():
            if key.startswith("GGUF."):
                continue
            got = m.metadata[key]
            want = field.contents()
            if isinstance(want, float):
                assert got == pytest.approx(want, rel=1e-7)
            elif isinstance(want, list) and want and isinstance(want[0], float):
                assert got == pytest.approx(want, rel=1e-7)
            else:
                assert got == want, key
            assert int(m.value_types[key]) == int(field.types[0])
            if len(field.types) > 1:
                assert int(m.array_types[key]) == int(field.types[1])
        assert isinstance(m.metadata["t.u64"], int) and isinstance(m.metadata["t.f32"], float)
        assert m.metadata["t.bool"] is True
        assert len(m.tensors) == len(ref.tensors)
        for rt in ref.tensors:
            info = m.tensors[rt.name]
            assert info.ne == tuple(int(x) for x in rt.shape)
            assert info.shape == tuple(reversed(info.ne))
            assert info.offset == rt.data_offset and info.nbytes == rt.n_bytes
            assert int(info.ggml_type) == int(rt.tensor_type)
            raw = m.raw(rt.name)
            assert raw.dtype == np.uint8
            assert np.array_equal(raw.reshape(-1), np.asarray(rt.data).view(np.uint8).reshape(-1))
        for name, a in typed.items():
            assert m.array(name).dtype == a.dtype and np.array_equal(m.array(name), a)
        for name, a in raws.items():
            assert np.array_equal(m.raw(name), a)
            assert m.array(name) is not None and m.array(name).dtype == np.uint8


def test_typed_metadata_rewrites_with_the_same_types(tmp_path):
    src = tmp_path / "ref.gguf"
    _write_with_gguf_py(src, np.random.default_rng(11))
    m = open_model(src)
    dst = tmp_path / "copy.gguf"
    write_gguf(dst, m.typed_metadata(), [])
    a, b = gguf.GGUFReader(str(src)).fields, gguf.GGUFReader(str(dst)).fields
    for key, field in a.items():
        if key.startswith("GGUF."):
            continue
        assert [int(t) for t in b[key].types] == [int(t) for t in field.types], key
        assert b[key].contents() == field.contents(), key


def test_views_are_zero_copy_and_read_only(tmp_path):
    path = tmp_path / "v.gguf"
    a = np.random.default_rng(2).integers(0, 256, (6, 2 * 17), dtype=np.uint8)
    write_gguf(path, {"k": 1}, [TensorSpec("mx", GGMLType.MXFP4, (64, 6), a)])
    m = open_model(path)
    raw = m.raw("mx")
    mm = m.files[0]._mm
    base = mm.__array_interface__["data"][0]
    assert raw.__array_interface__["data"][0] - base == m.tensors["mx"].offset
    assert not raw.flags.writeable
    with pytest.raises(ValueError):
        raw[0, 0] = 1
    m.close()
    assert np.array_equal(raw, a)  # a view handed out stays valid after close


def _string_cases(rng):
    alpha = [chr(c) for c in range(33, 127)] + ["é", "Ġ", "中", "🙂", "Ċ"]
    plain = ["".join(rng.choice(alpha, rng.integers(1, 12))) for _ in range(500)]
    return {
        "plain": plain,
        "empty_strings": ["", *plain[:50], "", "", *plain[50:60], ""],
        "long_strings": [p * 40 for p in plain[:30]] + plain[:20],
        "with_nul": ["a\0b", *plain[:10], "\0"],
        "single": ["x"],
        "none": [],
    }


def test_string_arrays_all_paths(tmp_path):
    cases = _string_cases(np.random.default_rng(3))
    path = tmp_path / "s.gguf"
    write_gguf(path, {f"s.{k}": (v, GGUFValueType.STRING) for k, v in cases.items()}, [])
    m = open_model(path)
    for k, v in cases.items():
        assert m.metadata[f"s.{k}"] == v, k
    ref = gguf.GGUFReader(str(path))
    for k, v in cases.items():
        assert ref.fields[f"s.{k}"].contents() == v


def test_invalid_utf8_is_replaced_with_warning(tmp_path, caplog):
    # a character split across two strings must not be glued back together by the fast path
    items = [b"ab", "é".encode()[:1], "é".encode()[1:], b"cd"]
    body = b"".join(struct.pack("<Q", len(x)) + x for x in items)
    kv = _str(b"k") + struct.pack("<IIQ", 9, 8, len(items)) + body
    path = tmp_path / "u.gguf"
    path.write_bytes(_header(n_kv=1, n_tensors=0) + kv)
    with caplog.at_level(logging.WARNING):
        m = open_model(path)
    assert m.metadata["k"] == ["ab", "\ufffd", "\ufffd", "cd"]
    assert "UTF-8" in caplog.text


# ---- hand-built bad files ----------------------------------------------------------------------
def _str(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def _header(n_kv: int, n_tensors: int, version: int = 3, magic: bytes = b"GGUF") -> bytes:
    return magic + struct.pack("<IQQ", version, n_tensors, n_kv)


def _tinfo(name: bytes, ne, t: int, off: int) -> bytes:
    return _str(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne) + \
        struct.pack("<IQ", t, off)


def _file(tinfos: list[bytes], data_bytes: int, kv: bytes = b"", n_kv: int = 0) -> bytes:
    head = _header(n_kv, len(tinfos)) + kv + b"".join(tinfos)
    head += b"\0" * (-len(head) % 32)
    return head + b"\0" * data_bytes


def _expect(tmp_path, blob: bytes, *words: str, name: str = "bad.gguf"):
    path = tmp_path / name
    path.write_bytes(blob)
    with pytest.raises(GGUFError) as e:
        open_model(path)
    msg = str(e.value)
    assert str(path) in msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


def test_bad_magic_and_version(tmp_path):
    _expect(tmp_path, _header(0, 0, magic=b"GGML"), "not a GGUF", "GGML")
    _expect(tmp_path, _header(0, 0, version=1), "unsupported GGUF version 1")
    _expect(tmp_path, _header(0, 0, version=4), "unsupported GGUF version 4")
    _expect(tmp_path, _header(0, 0, version=3 << 16), "big-endian")
    _expect(tmp_path, b"GGUF\x03\0", "truncated header")
    ok = tmp_path / "v2.gguf"
    ok.write_bytes(_header(0, 0, version=2))
    assert open_model(ok).tensors == {}


def test_missing_file(tmp_path):
    with pytest.raises(GGUFError, match="nope.gguf: model file not found"):
        open_model(tmp_path / "nope.gguf")
    d = tmp_path / "dir.gguf"
    d.mkdir()
    (d / "pad").write_bytes(bytes(64))
    with pytest.raises(GGUFError, match="dir.gguf: is a directory"):
        open_model(d)


def test_every_truncation_of_the_header_is_a_clear_error(tmp_path):
    kv = _str(b"a.s") + struct.pack("<I", 8) + _str(b"hello") + \
        _str(b"a.arr") + struct.pack("<IIQ", 9, 5, 3) + struct.pack("<3i", 1, 2, 3)
    full = _file([_tinfo(b"w", (32, 2), 0, 0)], 256, kv, n_kv=2)
    head_len = len(full) - 256
    for cut in range(head_len - 20):
        msg = _expect(tmp_path, full[:cut])
        assert "truncated" in msg or "exceeds the file size" in msg or "absurd" in msg


def test_truncated_data_names_the_tensor(tmp_path):
    blob = _file([_tinfo(b"blk.0.w", (32, 4), 0, 0)], 4 * 32 * 4 - 1)
    _expect(tmp_path, blob, "truncated data", "blk.0.w")


def test_unknown_type_names_tensor_and_id(tmp_path):
    _expect(tmp_path, _file([_tinfo(b"odd", (32,), 37, 0)], 64), "odd", "unknown ggml type id 37")


def test_duplicate_tensor_names(tmp_path):
    blob = _file([_tinfo(b"w", (32,), 0, 0), _tinfo(b"w", (32,), 0, 128)], 256)
    _expect(tmp_path, blob, "duplicate tensor name", "'w'")


def test_too_many_dims(tmp_path):
    _expect(tmp_path, _file([_tinfo(b"w", (1, 1, 1, 1, 1), 0, 0)], 64), "n_dims = 5")


def test_ne0_not_multiple_of_block(tmp_path):
    _expect(tmp_path, _file([_tinfo(b"mx", (48, 2), 39, 0)], 256), "mx", "not a multiple", "32")


def test_misaligned_offset(tmp_path):
    _expect(tmp_path, _file([_tinfo(b"w", (8,), 0, 4)], 64), "w", "alignment")


def test_absurd_counts_and_lengths(tmp_path):
    _expect(tmp_path, _header(10**12, 0), "absurd metadata count")
    _expect(tmp_path, _header(0, 10**12), "absurd tensor count")
    _expect(tmp_path, _header(1, 0) + struct.pack("<Q", 2**62) + b"xx", "string length",
            "exceeds")
    arr = _str(b"k") + struct.pack("<IIQ", 9, 6, 2**40)
    _expect(tmp_path, _header(1, 0) + arr + b"\0" * 64, "'k'", "exceeds the file size")
    sarr = _str(b"k") + struct.pack("<IIQ", 9, 8, 3) + _str(b"a") + struct.pack("<Q", 2**50)
    _expect(tmp_path, _header(1, 0) + sarr + b"\0" * 64, "'k'")
    _expect(tmp_path, _header(1, 0) + _str(b"k") + struct.pack("<I", 99) + b"\0" * 8,
            "unknown metadata value type 99")


def test_corrupt_counts_in_huge_sparse_file_fail_fast(tmp_path):
    """A 64 GB sparse file passes the file-size checks; limits must still stop corrupt counts."""
    def sparse(name, head):
        p = tmp_path / name
        with open(p, "wb") as f:
            f.write(head)
            f.truncate(64 << 30)
        return p

    for name, head, words in [
        ("kv.gguf", _header(10**9, 0), ("duplicate metadata key",)),
        ("tn.gguf", _header(0, 10**8), ("absurd tensor count",)),
        ("arr.gguf", _header(1, 0) + _str(b"k") + struct.pack("<IIQ", 9, 8, 10**9),
         ("absurd array length",)),
        ("tdup.gguf", _header(0, 1000), ("duplicate tensor name",)),
    ]:
        with pytest.raises(GGUFError) as e:
            open_model(sparse(name, head))
        assert all(w in str(e.value) for w in words), str(e.value)


def test_random_corruption_never_crashes(tmp_path):
    """Flipped header bytes either still parse or raise GGUFError; nothing else escapes."""
    rng = np.random.default_rng(4)
    src = tmp_path / "ok.gguf"
    write_gguf(src, {"a": 1, "s": ["x", "yy", "zzz"], "t": "text"},
               [TensorSpec("w", GGMLType.F32, (32, 2), np.zeros((2, 32), np.float32)),
                TensorSpec("q", GGMLType.Q8_0, (64,), np.zeros(68, np.uint8))])
    good = bytearray(src.read_bytes())
    head_len = len(good) - 512
    for i in range(300):
        bad = bytearray(good)
        for pos in rng.integers(0, head_len, rng.integers(1, 4)):
            bad[pos] = rng.integers(0, 256)
        p = tmp_path / f"c{i}.gguf"
        p.write_bytes(bytes(bad))
        try:
            open_model(p).close()
        except GGUFError:
            pass
        os.unlink(p)


# ---- require() ---------------------------------------------------------------------------------
def test_require(tmp_path):
    path = tmp_path / "r.gguf"
    write_gguf(path, {}, [TensorSpec("w", GGMLType.Q8_0, (64, 3), np.zeros((3, 68), np.uint8))])
    m = open_model(path)
    assert m.require("w", (64, 3), GGMLType.Q8_0).nbytes == 3 * 68
    assert m.require("w", [64, 3], [GGMLType.MXFP4, GGMLType.Q8_0]).name == "w"
    with pytest.raises(GGUFError, match=r"tensor 'w': expected shape .*\[64, 4\] got \[64, 3\]"):
        m.require("w", (64, 4))
    with pytest.raises(GGUFError, match="missing tensor 'v'"):
        m.require("v")
    with pytest.raises(GGUFError, match="type Q8_0 not supported here .*MXFP4"):
        m.require("w", None, GGMLType.MXFP4)
    with pytest.raises(GGUFError, match="missing tensor"):
        m.raw("nope")


# ---- split models ------------------------------------------------------------------------------
def _split_model(tmp_path, rng):
    tensors = [TensorSpec(f"t{i}", GGMLType.F32, (32, i + 1),
                          rng.standard_normal((i + 1, 32)).astype(np.float32)) for i in range(7)]
    paths = write_split(tmp_path / "m.gguf", {"general.architecture": "gpt-oss", "x": 5}, tensors,
                        max_shard_bytes=600)
    return tensors, paths


def test_split_model_merges_shards(tmp_path):
    tensors, paths = _split_model(tmp_path, np.random.default_rng(5))
    assert len(paths) >= 3 and paths[0].endswith("-00001-of-%05d.gguf" % len(paths))
    for opened in (paths[0], paths[-1]):  # any shard name opens the whole model
        m = open_model(opened)
        assert m.metadata["x"] == 5 and m.metadata["split.count"] == len(paths)
        assert sorted(m.tensors) == sorted(t.name for t in tensors)
        assert len({i.file_index for i in m.tensors.values()}) == len(paths)
        for t in tensors:
            assert np.array_equal(m.array(t.name), t.data)
        m.close()


def test_split_missing_shard(tmp_path):
    _, paths = _split_model(tmp_path, np.random.default_rng(6))
    os.unlink(paths[1])
    with pytest.raises(GGUFError, match=f"missing shard {paths[1]}"):
        open_model(paths[0])


def test_split_count_mismatch(tmp_path):
    paths = [str(tmp_path / f"m-{k:05d}-of-00002.gguf") for k in (1, 2)]
    for k, p in enumerate(paths):
        write_gguf(p, {"split.no": (k, GGUFValueType.UINT16),
                       "split.count": (3, GGUFValueType.UINT16)}, [])
    with pytest.raises(GGUFError, match="split.count = 3 but the file name says 2"):
        open_model(paths[0])


def test_split_count_without_shard_name(tmp_path):
    path = tmp_path / "plain.gguf"
    write_gguf(path, {"split.count": (3, GGUFValueType.UINT16)}, [])
    with pytest.raises(GGUFError, match="cannot find the shards"):
        open_model(path)


def test_sparse_large_file_opens_without_reading(tmp_path):
    path = tmp_path / "big.gguf"
    ne = (2880, 2880, 32)  # one 20b expert tensor: 141 MB of hole
    write_gguf(path, {"a": 1}, [TensorSpec("blk.0.ffn_up_exps.weight", GGMLType.MXFP4, ne)],
               sparse=True)
    assert os.stat(path).st_blocks * 512 < 1 << 20
    m = open_model(path)
    raw = m.raw("blk.0.ffn_up_exps.weight")
    assert raw.shape == (32, 2880, 90 * 17)
    assert not raw[31, 2879].any()


# ---- `hybridmoe inspect` -----------------------------------------------------------------------
def test_inspect_command_prints_summary_without_torch(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "i.gguf"
    write_gguf(path, {"general.architecture": "gpt-oss", "tokenizer.ggml.tokens":
                      [f"t{i}" for i in range(1000)], "small": [1, 2, 3], "chat": "x" * 5000},
               [TensorSpec("blk.0.ffn_up_exps.weight", GGMLType.MXFP4, (64, 4, 2)),
                TensorSpec("w", GGMLType.F32, (32,))], sparse=True)
    code = ("import sys; from hybridmoe.cli import main; rc = main(['inspect', '-m', sys.argv[1]]);"
            "assert 'torch' not in sys.modules, 'inspect imported torch'; sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "STRING[]" in out and "INT32[]" in out
    assert "[1000 strings]" in out and "[1, 2, 3]" in out and "(5000 chars)" in out
    assert "blk.0.ffn_up_exps.weight" in out and "[64, 4, 2]" in out and "272" in out
    assert "MXFP4" in out and "total" in out
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(40))
    r = subprocess.run([sys.executable, "-m", "hybridmoe.cli", "inspect", "-m", str(bad)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "not a GGUF file" in r.stderr


def test_bad_alignment_key(tmp_path):
    path = tmp_path / "a.gguf"
    write_gguf(path, {"general.alignment": (48, GGUFValueType.UINT32)}, [])
    with pytest.raises(GGUFError, match="general.alignment = 48 is not a positive power of two"):
        open_model(path)
