"""Fixture for the kernel tests: force a kernel variant, restore automatic dispatch after."""

from __future__ import annotations

import pytest

import hybridmoe.kernels as K


@pytest.fixture
def use_isa(request):
    """Forces the variant named by the test's `isa` param, then restores automatic dispatch."""
    yield lambda name: K.set_isa(name)
    if K.available():
        K.set_isa("auto")
        K.set_gemv_max_tokens(None)  # the library's defaults
        K.set_gemv_max_tokens(None, fast_math=True)
        K.set_num_threads(1)




@pytest.fixture(params=[K.Activations.INT16, K.Activations.INT8X3, K.Activations.FP32], ids=["int16", "int8x3", "fp32"])
def act_mode(request) -> K.Activations:
    """The activation mode to pass (`act=`): int16 or three int8 digits on the GEMV path, and fp32
    (the default)."""
    return request.param
