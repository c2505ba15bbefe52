"""YaRN inverse frequencies against transformers, including configs whose correction range must be
clamped to [0, head_dim - 1] (a small original context or base makes low < 0)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridmoe import LLM, ComputeSettings
from hybridmoe.models.layers import yarn_inv_freq
from tests.hf_reference import build_pair

# (head_dim, base, original_ctx): gpt-oss's own; low < 0 (small context); high > head_dim - 1 (big
# context, small base); both clamps at once.
CASES = [(64, 150000.0, 4096), (16, 150000.0, 64), (16, 500.0, 4096), (16, 20.0, 32), (64, 10000.0, 8)]


def _hf_inv_freq(head_dim: int, base: float, original_ctx: int) -> tuple[torch.Tensor, float]:
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = GptOssConfig(head_dim=head_dim, max_position_embeddings=original_ctx * 32,
                       rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                        "original_max_position_embeddings": original_ctx, "truncate": False,
                                        "rope_theta": base})
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    return inv.double(), float(factor)


@pytest.mark.parametrize("head_dim,base,original_ctx", CASES)
def test_inv_freq_matches_transformers(head_dim: int, base: float, original_ctx: int) -> None:
    ours, conc = yarn_inv_freq(head_dim, base, 32.0, original_ctx)
    ref, ref_conc = _hf_inv_freq(head_dim, base, original_ctx)
    assert torch.isfinite(ours).all()
    # transformers builds the ramp in float32: agreement to float32 rounding, not bit for bit.
    np.testing.assert_allclose(ours.double().numpy(), ref.numpy(), rtol=2e-6, atol=0)
    assert conc == pytest.approx(ref_conc, rel=1e-12)


def test_clamped_range_logits_match_transformers(tmp_path) -> None:
    """original context 64 with head_dim 16: low = -0.9 before clamping; every position after the
    first differed from transformers without the clamp."""
    path = tmp_path / "yarn-clamp.gguf"
    hf = build_pair(path, seed=5, layers=2, window=16, original_ctx=64, rope_theta=150000.0)
    llm = LLM(path, compute=ComputeSettings(threads=1))
    ids = torch.randint(0, llm.config.vocab_size, (96,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float().numpy()
    ours = llm.logits(ids.tolist())
    assert np.isfinite(ours).all()
    err = float(np.abs(ours - ref).max() / np.abs(ref).max())
    assert err < 1e-4, f"relative error {err:.2e}"
