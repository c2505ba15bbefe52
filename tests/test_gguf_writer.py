"""Our GGUF writer: metadata typing, streaming, sparse holes, alignment, splits; read back by
our reader and by gguf.GGUFReader."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from hybridmoe.gguf import GGMLType, TensorSpec, open_model, write_gguf, write_split
from hybridmoe.gguf.constants import GGUFValueType as VT
from hybridmoe.gguf.writer import shard_path


def _fields(path):
    r = gguf.GGUFReader(str(path))
    return r, {k: f for k, f in r.fields.items() if not k.startswith("GGUF.")}


def test_metadata_typing(tmp_path):
    meta = {
        "i.small": 7, "i.neg": -3, "i.big": 2**40, "i.np": np.int64(9), "f": 1.5,
        "f.np": np.float32(0.25), "b": True, "s": "héllo",
        "l.str": ["a", "ü", ""], "l.int": [1, -2, 3], "l.npint": np.arange(4, dtype=np.int64),
        "l.float": [0.5, 2.0], "l.npfloat": np.array([1.5, 2.5]), "l.bool": [True, False],
        "o.u16": (3, VT.UINT16), "o.i64": (-5, VT.INT64), "o.f64": (0.1, VT.FLOAT64),
        "o.list_u8": ([1, 2, 255], VT.UINT8), "o.arr": ([1.0, 2.0], VT.ARRAY),
    }
    want = {
        "i.small": [VT.UINT32], "i.neg": [VT.INT32], "i.big": [VT.UINT64], "i.np": [VT.UINT32],
        "f": [VT.FLOAT32], "f.np": [VT.FLOAT32], "b": [VT.BOOL], "s": [VT.STRING],
        "l.str": [VT.ARRAY, VT.STRING], "l.int": [VT.ARRAY, VT.INT32],
        "l.npint": [VT.ARRAY, VT.INT32], "l.float": [VT.ARRAY, VT.FLOAT32],
        "l.npfloat": [VT.ARRAY, VT.FLOAT32], "l.bool": [VT.ARRAY, VT.BOOL],
        "o.u16": [VT.UINT16], "o.i64": [VT.INT64], "o.f64": [VT.FLOAT64],
        "o.list_u8": [VT.ARRAY, VT.UINT8], "o.arr": [VT.ARRAY, VT.FLOAT32],
    }
    path = tmp_path / "m.gguf"
    write_gguf(path, meta, [])
    _, fields = _fields(path)
    assert set(fields) == set(meta)
    for k, types in want.items():
        assert [int(t) for t in fields[k].types] == [int(t) for t in types], k
    m = open_model(path)
    for k, v in meta.items():
        v = v[0] if isinstance(v, tuple) else v
        v = v.tolist() if isinstance(v, (np.ndarray, np.generic)) else v
        assert _same(m.metadata[k], v), k
        assert _same(fields[k].contents(), v), k


def _same(got, want) -> bool:
    if isinstance(want, list):
        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))
    if isinstance(want, float):
        return isinstance(got, float) and got == pytest.approx(want, rel=1e-7)
    return type(got) is type(want) and got == want


@pytest.mark.parametrize("bad, err", [
    ({"k": (70000, VT.UINT16)}, "does not fit UINT16"),
    ({"k": (-1, VT.UINT32)}, "does not fit UINT32"),
    ({"k": ([1, 300], VT.UINT8)}, "do not fit UINT8"),
    ({"k": {"nested": 1}}, "cannot store"),
    ({"k": [1, "a"]}, "cannot store"),
])
def test_metadata_errors(tmp_path, bad, err):
    with pytest.raises((ValueError, TypeError), match=err):
        write_gguf(tmp_path / "x.gguf", bad, [])


def _random_tensors(rng):
    return [
        TensorSpec("f32", GGMLType.F32, (32, 3), rng.standard_normal((3, 32)).astype(np.float32)),
        TensorSpec("f16", GGMLType.F16, (64, 2, 2),
                   rng.standard_normal((2, 2, 64)).astype(np.float16)),
        TensorSpec("bf16", GGMLType.BF16, (32, 5), rng.integers(0, 2**16, (5, 32), np.uint16)),
        TensorSpec("q8", GGMLType.Q8_0, (64, 3), rng.integers(0, 256, (3, 68), np.uint8)),
        TensorSpec("mx", GGMLType.MXFP4, (96, 4, 2), rng.integers(0, 256, (2, 4, 51), np.uint8)),
        TensorSpec("vec", GGMLType.F32, (7,), rng.standard_normal(7).astype(np.float32)),
    ]


@pytest.mark.parametrize("alignment", [32, 64])
def test_tensors_round_trip_both_readers(tmp_path, alignment):
    tensors = _random_tensors(np.random.default_rng(alignment))
    path = tmp_path / "t.gguf"
    size = write_gguf(path, {"general.architecture": "gpt-oss"}, tensors, alignment=alignment)
    assert size == os.path.getsize(path)
    ref = gguf.GGUFReader(str(path))
    assert ref.alignment == alignment
    by_name = {t.name: t for t in ref.tensors}
    m = open_model(path)
    if alignment != 32:
        assert m.metadata["general.alignment"] == alignment
    for t in tensors:
        info = m.tensors[t.name]
        assert info.ne == tuple(t.ne) and info.offset % alignment == 0
        assert np.array_equal(m.raw(t.name).reshape(-1), t.data.view(np.uint8).reshape(-1))
        rt = by_name[t.name]
        assert tuple(int(x) for x in rt.shape) == tuple(t.ne)
        assert int(rt.tensor_type) == int(t.ggml_type)
        assert np.array_equal(np.asarray(rt.data).view(np.uint8).reshape(-1),
                              t.data.view(np.uint8).reshape(-1))


def test_streaming_chunks(tmp_path):
    rng = np.random.default_rng(8)
    data = rng.integers(0, 256, (16, 5 * 17), dtype=np.uint8)

    def chunks():
        for row in data:  # mixed chunk kinds
            yield row[:40].tobytes()
            yield row[40:]

    path = tmp_path / "s.gguf"
    write_gguf(path, {}, [TensorSpec("mx", GGMLType.MXFP4, (160, 16), chunks)])
    assert np.array_equal(open_model(path).raw("mx"), data)


@pytest.mark.parametrize("n_rows", [15, 17])
def test_streaming_wrong_size_names_tensor(tmp_path, n_rows):
    def chunks():
        for _ in range(n_rows):
            yield bytes(68)

    with pytest.raises(ValueError, match="tensor 'q8'"):
        write_gguf(tmp_path / "s.gguf", {}, [TensorSpec("q8", GGMLType.Q8_0, (64, 16), chunks)])


def test_array_wrong_size_and_missing_data(tmp_path):
    x = np.zeros((3, 32), np.float64)  # float64 where F32 bytes are expected
    with pytest.raises(ValueError, match="tensor 'w': data has 768 bytes"):
        write_gguf(tmp_path / "a.gguf", {}, [TensorSpec("w", GGMLType.F32, (32, 3), x)])
    with pytest.raises(ValueError, match="needs sparse=True"):
        write_gguf(tmp_path / "b.gguf", {}, [TensorSpec("w", GGMLType.F32, (32, 3))])
    with pytest.raises(ValueError, match="not a multiple"):
        write_gguf(tmp_path / "c.gguf", {}, [TensorSpec("w", GGMLType.MXFP4, (48,))], sparse=True)
    with pytest.raises(ValueError, match="llama.cpp allows at most 63"):
        write_gguf(tmp_path / "e.gguf", {}, [TensorSpec("n" * 64, GGMLType.F32, (8,))], sparse=True)
    with pytest.raises(ValueError, match="duplicate tensor name"):
        write_gguf(tmp_path / "d.gguf", {}, [TensorSpec("w", GGMLType.F32, (8,))] * 2, sparse=True)


def test_sparse_hole_costs_no_disk(tmp_path):
    rng = np.random.default_rng(9)
    small = rng.standard_normal(32).astype(np.float32)
    tensors = [TensorSpec("big", GGMLType.MXFP4, (2880, 2880, 64)),  # 282 MB hole
               TensorSpec("small", GGMLType.F32, (32,), small)]
    path = tmp_path / "sparse.gguf"
    size = write_gguf(path, {"a": 1}, tensors, sparse=True)
    assert size == os.path.getsize(path) > 282_000_000
    assert os.stat(path).st_blocks * 512 < 1 << 20
    m = open_model(path)
    assert np.array_equal(m.array("small"), small)
    assert not m.raw("big")[-1, -1].any()
    assert gguf.GGUFReader(str(path)).tensors[0].n_bytes == m.tensors["big"].nbytes


def test_split_files(tmp_path):
    rng = np.random.default_rng(10)
    tensors = [TensorSpec(f"t{i}", GGMLType.F32, (64,), rng.standard_normal(64).astype(np.float32))
               for i in range(5)]
    paths = write_split(tmp_path / "model.gguf", {"k": "v"}, tensors, max_shard_bytes=512)
    assert paths == [shard_path(tmp_path / "model.gguf", k, 3) for k in (1, 2, 3)]
    assert paths[0].endswith("model-00001-of-00003.gguf")
    for k, p in enumerate(paths):
        _, fields = _fields(p)
        assert fields["split.no"].contents() == k and int(fields["split.no"].types[0]) == VT.UINT16
        assert fields["split.count"].contents() == 3
        assert fields["split.tensors.count"].contents() == 5
        assert ("k" in fields) == (k == 0)
    m = open_model(paths[0])
    for t in tensors:
        assert np.array_equal(m.array(t.name), t.data)
