"""The attention code an accelerator runs (sink as a softmax column, scalar masks for one query)
against the CPU's fused flash path, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.models.layers import _attend, _hidden_keys, attend_sink_column


@pytest.mark.parametrize("n,masked", [(1, False), (1, True), (5, True), (7, False)])
def test_sink_column_attention_matches_the_cpu_flash_path(n, masked):
    g, Hkv, d, S = 8, 2, 64, 37
    gen = torch.Generator().manual_seed(n * 10 + masked)
    q = torch.randn(Hkv, g * n, d, generator=gen)
    k, v = torch.randn(Hkv, S, d, generator=gen), torch.randn(Hkv, S, d, generator=gen)
    sink = torch.randn(Hkv, g, 1, generator=gen) * 3
    hidden = (torch.rand(n, S, generator=gen) < 0.4) if masked else None
    blind = masked and n > 1
    if blind:
        hidden[0] = True  # a query that sees no key: only the sink, so a zero output (flash: NaN)
    ref = _attend(q, k, v, hidden, g, n, 0.125, sink).view(Hkv, g, n, d)
    got = attend_sink_column(q, k, v, hidden, g, n, 0.125, sink).view(Hkv, g, n, d)
    assert torch.isfinite(got).all()
    seen = slice(1 if blind else 0, n)
    err = (got[:, :, seen] - ref[:, :, seen]).abs().max() / ref[:, :, seen].abs().max()
    assert err < 2e-6, err
    if blind:
        assert got[:, :, 0].abs().max() == 0


@pytest.mark.parametrize("window", [None, 4, 16])
def test_one_query_mask_from_a_scalar_equals_the_position_mask(window):
    gen = torch.Generator().manual_seed(window or 0)
    p = 40
    k_pos = torch.randperm(p + 1, generator=gen)[:24]  # a ring's positions, none past the query
    k_pos[torch.rand(24, generator=gen) < 0.25] = -1  # empty rows
    q_pos = torch.tensor([p])
    scalar = _hidden_keys(q_pos, k_pos, 0, 1, window, False, p)
    tensor = _hidden_keys(q_pos, k_pos, 0, 1, window, False, None)
    assert torch.equal(scalar, tensor)
    assert _hidden_keys(q_pos, torch.arange(p + 1), 0, 1, None, True, p) is None


def test_model_through_the_accelerator_attention_matches_the_default(tiny_gguf, monkeypatch):
    # Every layer on TorchAttention with the sink-column core (what a GPU layer runs), against the
    # default CPU model: a prefill past the window, then batched decode steps of two sequences.
    import numpy as np

    from hybridmoe.gguf.reader import open_model
    from hybridmoe.models import layers
    from hybridmoe.models.attention import TorchAttention
    from hybridmoe.models.gpt_oss import GptOss, SeqChunk

    mf = open_model(tiny_gguf)
    base = GptOss(mf)
    monkeypatch.setattr(layers, "_attend", layers.attend_sink_column)
    model = GptOss(mf)
    for layer in model.layers:
        a = layer.attention.attend
        layer.attention.attend = TorchAttention(a.layer, a.n_heads, a.sinks, a.scale, a.window)
    ids = np.random.default_rng(3).integers(0, base.config.vocab_size, size=2 * base.config.sliding_window + 9).tolist()
    caches = {m: [m.make_cache(len(ids) + 8) for _ in range(2)] for m in (base, model)}
    logits = {m: m.forward([SeqChunk(caches[m][0], ids), SeqChunk(caches[m][1], ids[:5])]) for m in (base, model)}
    for step in range(6):
        got, ref = logits[model], logits[base]
        assert torch.isfinite(got).all()
        assert ((got - ref).abs().max() / ref.abs().max()) < 1e-5, step
        toks = [int(t) for t in ref.argmax(-1)]
        logits = {m: m.forward([SeqChunk(caches[m][0], [toks[0]]), SeqChunk(caches[m][1], [toks[1]])])
                  for m in (base, model)}
