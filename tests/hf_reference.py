"""Build a random transformers GptOssForCausalLM and write the same weights to a GGUF file.

Experts are rounded to MXFP4-representable values first, so both sides hold identical weights.
The HF init (std 0.02) makes nearly uniform routing and tiny expert outputs; weights are redrawn
at fan-in scale so routing, sinks and the SwiGLU clamp all matter to the logits.
"""

from __future__ import annotations

from pathlib import Path

import torch

from collections.abc import Callable

import numpy as np

from hybridmoe.convert import (
    gguf_to_hf_state,
    gpt_oss_metadata,
    hf_to_gguf_tensors,
    mxfp4_roundtrip_experts,
    roundtrip,
)
from hybridmoe.gguf.constants import GGMLType
from hybridmoe.gguf.reader import open_model
from hybridmoe.gguf.writer import write_gguf
from hybridmoe.quant.formats import dequantize
from hybridmoe.tokenizer.synthetic import make_vocab


def build_pair(
    path: Path,
    *,
    seed: int = 0,
    layers: int = 4,
    hidden: int = 64,
    heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 16,
    experts: int = 8,
    top_k: int = 2,
    ffn: int = 64,
    window: int = 32,
    vocab: int = 1024,
    dense_type: GGMLType = GGMLType.F32,
    rope_theta: float = 150000.0,
    original_ctx: int = 4096,
    type_for: Callable[[str, tuple[int, ...]], GGMLType] | None = None,
):
    """type_for(gguf_name, ne): each quantized tensor's type (a llama-quantize mix); the file is
    then written first and the HF model takes the file's dequantized values."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    cfg = GptOssConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        num_local_experts=experts, num_experts_per_tok=top_k, sliding_window=window,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": original_ctx,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": rope_theta},
    )
    cfg._attn_implementation = "eager"
    model = GptOssForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    state = model.state_dict()
    for name, t in state.items():
        if name.endswith(("layernorm.weight", "norm.weight")):
            state[name] = 1.0 + 0.1 * torch.randn(t.shape, generator=g)
        elif name.endswith("sinks"):
            state[name] = torch.randn(t.shape, generator=g)
        elif name.endswith("bias"):
            state[name] = 0.1 * torch.randn(t.shape, generator=g)
        elif name.endswith(("gate_up_proj", "down_proj")):
            state[name] = torch.randn(t.shape, generator=g) / t.shape[1] ** 0.5 * 2.0
        else:
            fan_in = t.shape[-1]
            state[name] = torch.randn(t.shape, generator=g) / fan_in**0.5
    mxfp4_roundtrip_experts(state, layers)
    if dense_type != GGMLType.F32:
        for name in list(state):
            if name.endswith(("proj.weight", "embed_tokens.weight", "lm_head.weight")) and "experts" not in name:
                state[name] = roundtrip(state[name], dense_type)
    meta = gpt_oss_metadata(cfg, make_vocab(vocab, seed, "tiny"), name="hf-random")
    if type_for is not None:
        write_gguf(path, meta, hf_to_gguf_tensors(state, layers, type_for=type_for))
        state = dequantized_state(path, layers)
    else:
        write_gguf(path, meta, hf_to_gguf_tensors(state, layers, dense_type=dense_type))
    model.load_state_dict(state)
    return model


def dequantized_state(path: Path, layers: int) -> dict[str, torch.Tensor]:
    """A GGUF file's tensors as the HF state_dict they encode (every type through our reference
    dequantizer, which the quant tests hold bit-exact to gguf-py's)."""
    with open_model(path) as mf:
        def tensor(name: str) -> torch.Tensor:
            info = mf.tensors[name]
            vals = dequantize(mf.raw(name), info.ggml_type)
            return torch.from_numpy(np.array(vals, dtype=np.float32).reshape(info.shape))

        return gguf_to_hf_state(tensor, layers)
