"""hybridmoe.convert's two directions are inverses: HF state_dict -> GGUF file -> HF state_dict gives
back every tensor (exactly: dense F32, experts already on the MXFP4 grid)."""

from __future__ import annotations

import numpy as np
import torch

from hybridmoe.convert import gguf_to_hf_state
from hybridmoe.gguf.reader import open_model
from hybridmoe.quant.formats import dequantize
from tests.hf_reference import build_pair


def test_gguf_to_hf_state_inverts_hf_to_gguf_tensors(tmp_path):
    path = tmp_path / "pair.gguf"
    model = build_pair(path, seed=11, layers=2)
    want = model.state_dict()
    with open_model(path) as mf:
        def tensor(name: str) -> torch.Tensor:
            info = mf.tensors[name]
            raw = mf.array(name) if info.ggml_type.name == "F32" else dequantize(mf.raw(name), info.ggml_type)
            return torch.from_numpy(np.array(raw, dtype=np.float32).reshape(info.shape))

        got = gguf_to_hf_state(tensor, 2)
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].shape == t.shape, name
        assert torch.equal(got[name], t.float()), name
