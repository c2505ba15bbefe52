"""C RMSNorm (decode steps) against torch's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hybridmoe.kernels as K

from kernel_helpers import rel_err

pytestmark = pytest.mark.skipif(not K.available(), reason="compiled kernels not built (torch fallback only)")


@pytest.mark.parametrize("shape", [(1, 2880), (5, 64), (2, 3, 96)])
def test_matches_torch(shape):
    rng = np.random.default_rng()
    x = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)) * 30
    w = torch.from_numpy(rng.standard_normal(shape[-1], dtype=np.float32))
    y = K.rms_norm(x, w, 1e-5)
    ref = torch.nn.functional.rms_norm(x.double(), (shape[-1],), w.double(), 1e-5)
    assert y.shape == x.shape and rel_err(y, ref) < 1e-6  # observed ~1e-7


def test_nan_row_stays_nan_and_alone():
    x = torch.randn(3, 64)
    x[1, 5] = float("nan")
    y = K.rms_norm(x, torch.ones(64), 1e-5)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all() and torch.isfinite(y[2]).all()


def test_bad_shape_is_named():
    with pytest.raises(ValueError, match="x has 64 features, weight 32"):
        K.rms_norm(torch.zeros(2, 64), torch.ones(32), 1e-5)
