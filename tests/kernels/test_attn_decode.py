"""Decode attention kernel (rope + cache write + attention with sinks in one call) against the
torch path the model uses for prefill (layers.apply_rope_neox + attention_with_sinks)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import hybridmoe.kernels as K
from hybridmoe.models.layers import RopeTable, apply_rope_neox, attention_with_sinks, yarn_inv_freq

from kernel_helpers import isa_params, rel_err

# fp32 dot products over d and softmax sums over <= 300 keys: observed ~1e-7, stated bound 1e-5.
TOL = 1e-5

pytestmark = pytest.mark.skipif(not K.available(), reason="compiled kernels not built (torch fallback only)")


def _case(rng, Hq, Hkv, d, rows):
    t = lambda *s: torch.from_numpy(rng.standard_normal(s, dtype=np.float32))  # noqa: E731
    inv, conc = yarn_inv_freq(d, 150000.0, 32.0, 4096)
    return t(Hq, d), t(Hkv, d), t(Hkv, d), t(Hkv, rows, d), t(Hkv, rows, d), t(Hq), RopeTable(inv, conc)


def _rope(q, k, cos, sin):
    """The model's torch rope: q -> [1, Hq, d], k -> [Hkv, d]."""
    return (apply_rope_neox(q[None], cos[None, None], sin[None, None]),
            apply_rope_neox(k[None], cos[None, None], sin[None, None])[0])


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("Hq,Hkv,d", [(8, 2, 64), (4, 4, 16), (6, 1, 12), (64, 8, 64)])
def test_full_layer_matches_torch_path(isa, Hq, Hkv, d, use_isa):
    use_isa(isa)
    rng = np.random.default_rng()
    rows, pos = 300, 257  # keys 0..257 visible; rows past pos hold stale data the call must ignore
    q, k, v, Kc, Vc, sinks, rope = _case(rng, Hq, Hkv, d, rows)
    cos, sin = (t[0, 0].contiguous() for t in rope.cos_sin(torch.tensor([pos]), torch.device("cpu")))
    Kc[:, pos + 1 :] = float("nan")  # beyond n_keys: must never be read
    scale = 1.0 / math.sqrt(d)
    Kref, Vref = Kc.clone(), Vc.clone()
    qr, kr = _rope(q, k, cos, sin)
    Kref[:, pos], Vref[:, pos] = kr, v
    ref = attention_with_sinks(qr, Kref[:, : pos + 1], Vref[:, : pos + 1], sinks, torch.tensor([pos]),
                               torch.arange(pos + 1), scale, None, keys_in_order=True)[0]
    out = K.attn_decode(q, k, v, cos, sin, Kc, Vc, pos, None, pos, pos + 1, 0, sinks, scale)
    assert out.shape == (Hq, d) and torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL
    assert rel_err(Kc[:, pos], kr) < TOL and torch.equal(Vc[:, pos], v)  # roped key, value as is
    assert rel_err(q, qr[0]) < TOL  # q roped in place


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("window", [8, 0])
def test_ring_layer_window_wrap_and_empty_rows(isa, window, use_isa):
    use_isa(isa)
    rng = np.random.default_rng()
    Hq, Hkv, d, rows, pos = 8, 2, 64, 20, 45
    q, k, v, Kc, Vc, sinks, rope = _case(rng, Hq, Hkv, d, rows)
    cos, sin = (t[0, 0].contiguous() for t in rope.cos_sin(torch.tensor([pos]), torch.device("cpu")))
    # Slots hold positions 26..44 (wrapped), two of them emptied, one holding a "future" entry.
    kpos = torch.roll(torch.arange(26, 46, dtype=torch.int64), 26 % rows)
    kpos[kpos == pos] = -1
    kpos[3], kpos[11] = -1, pos + 3
    row = pos % rows
    scale = 0.125
    Kref, Vref, Pref = Kc.clone(), Vc.clone(), kpos.clone()
    qr, kr = _rope(q, k, cos, sin)
    Kref[:, row], Vref[:, row], Pref[row] = kr, v, pos
    ref = attention_with_sinks(qr, Kref, Vref, sinks, torch.tensor([pos]), Pref, scale, window or None)[0]
    out = K.attn_decode(q, k, v, cos, sin, Kc, Vc, row, kpos, pos, rows, window, sinks, scale)
    assert rel_err(out, ref) < TOL
    assert int(kpos[row]) == pos and torch.equal(kpos, Pref)


@pytest.mark.parametrize("isa", isa_params())
def test_nan_reaches_the_output(isa, use_isa):
    use_isa(isa)
    rng = np.random.default_rng()
    q, k, v, Kc, Vc, sinks, _ = _case(rng, 8, 2, 64, 16)
    q[5, 7] = float("nan")
    out = K.attn_decode(q, k, v, None, None, Kc, Vc, 9, None, 9, 10, 0, sinks, 0.125)
    assert torch.isnan(out[5]).all()  # the poisoned head...
    assert torch.isfinite(out[:4]).all() and torch.isfinite(out[6:]).all()  # ...and only it
    v[1, 0] = float("nan")  # the new value row of KV head 1 (heads 4..7) is visible to them
    q[5, 7] = 0.0
    out = K.attn_decode(q, k, v, None, None, Kc, Vc, 9, None, 9, 10, 0, sinks, 0.125)
    assert torch.isnan(out[4:, 0]).all() and torch.isfinite(out[:4]).all()


def test_bad_arguments_are_named():
    rng = np.random.default_rng()
    q, k, v, Kc, Vc, sinks, _ = _case(rng, 8, 2, 64, 16)
    with pytest.raises(ValueError, match="row=16"):
        K.attn_decode(q, k, v, None, None, Kc, Vc, 16, None, 15, 16, 0, sinks, 0.125)
    with pytest.raises(ValueError, match="n_keys=17"):
        K.attn_decode(q, k, v, None, None, Kc, Vc, 3, None, 3, 17, 0, sinks, 0.125)
    with pytest.raises(ValueError, match="float32"):
        K.attn_decode(q.double(), k, v, None, None, Kc, Vc, 3, None, 3, 4, 0, sinks, 0.125)
    with pytest.raises(ValueError, match="sinks has 7"):
        K.attn_decode(q, k, v, None, None, Kc, Vc, 3, None, 3, 4, 0, sinks[:7], 0.125)
