"""bench/roofline.py's byte count: the expected distinct experts against a simulation of top-k
routing, and the bytes of a step against a count made tensor by tensor from the file."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import roofline  # noqa: E402


@pytest.mark.parametrize("n_experts,top_k", [(32, 4), (128, 4), (8, 2)])
@pytest.mark.parametrize("streams", [1, 2, 4, 8])
def test_distinct_experts_matches_simulated_routing(n_experts, top_k, streams):
    rng = np.random.default_rng(n_experts * 100 + streams)
    trials = 20000
    picks = np.argsort(rng.random((trials, streams, n_experts)), axis=-1)[..., :top_k]
    seen = np.zeros((trials, n_experts), dtype=bool)
    for s in range(streams):
        np.put_along_axis(seen, picks[:, s], True, axis=1)
    simulated = seen.sum(1).mean()
    expected = roofline.distinct_experts(n_experts, top_k, streams)
    assert abs(expected - simulated) < 0.02 * n_experts ** 0.5, (expected, simulated)
    if streams == 1:
        assert expected == pytest.approx(top_k)


def test_step_bytes_counts_each_tensor_once(tiny_gguf):
    from hybridmoe.gguf.reader import open_model
    from hybridmoe.gpt_oss_config import GptOssConfig

    mf = open_model(tiny_gguf)
    cfg = GptOssConfig.from_metadata(mf.metadata)
    infos = mf.tensors.values()
    experts = sum(i.nbytes for i in infos if "_exps." in i.name)
    embedding = mf.info("token_embd.weight").nbytes
    dense = sum(i.nbytes for i in infos) - experts - embedding
    b = roofline.step_bytes(mf.tensors, cfg.n_experts, cfg.n_experts_used, cfg.n_layers, cfg.vocab_size, 1)
    assert b["dense"] == dense
    assert b["experts"] == pytest.approx(experts * cfg.n_experts_used / cfg.n_experts)
    assert b["total"] == pytest.approx(dense + embedding / cfg.vocab_size + experts * cfg.n_experts_used / cfg.n_experts)
    every = roofline.step_bytes(mf.tensors, cfg.n_experts, cfg.n_experts_used, cfg.n_layers, cfg.vocab_size, 10_000)
    assert every["experts"] == pytest.approx(experts)  # enough streams touch every expert once
