"""Hugging Face GptOss weights -> GGUF tensors laid out as llama.cpp's converter writes them.

Used by the correctness tests (a random `GptOssForCausalLM` written to GGUF) and by the demo
model export. gate/up are interleaved columns in HF ([E, H, 2I], even = gate, odd = up); GGUF
stores them as two tensors of rows [E, I, H] with MXFP4 blocks running along the input (H) axis.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from hybridmoe.gguf.constants import GGMLType
from hybridmoe.gguf.writer import TensorSpec
from hybridmoe.gpt_oss_config import (
    ARCH,
    DEFAULT_ROPE_ORIGINAL_CTX,
    DEFAULT_YARN_BETA_FAST,
    DEFAULT_YARN_BETA_SLOW,
    GptOssConfig,
)
from hybridmoe.quant.formats import dequantize, quantize


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().numpy()


def encode(x: np.ndarray, t: GGMLType) -> np.ndarray:
    """float32 values -> stored form of type t (raw bytes for block types)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if t == GGMLType.F32:
        return x
    return quantize(x, t)


def roundtrip(x: torch.Tensor, t: GGMLType) -> torch.Tensor:
    """Values as they come back after storing in type t (quantize along the last axis)."""
    if t == GGMLType.F32:
        return x.clone()
    arr = _np(x)
    back = dequantize(quantize(np.ascontiguousarray(arr), t), t).reshape(arr.shape)
    return torch.from_numpy(back).to(x.dtype)


def mxfp4_roundtrip_experts(state: dict[str, torch.Tensor], n_layers: int) -> None:
    """In place: replace HF expert matrices by their MXFP4-representable values (blocks along
    the input axis, as GGUF stores them), so HF and the GGUF file hold identical weights."""
    for i in range(n_layers):
        p = f"model.layers.{i}.mlp.experts."
        gu = state[p + "gate_up_proj"]  # [E, H, 2I]: blocks along H = dim 1
        state[p + "gate_up_proj"] = roundtrip(gu.transpose(1, 2), GGMLType.MXFP4).transpose(1, 2).contiguous()
        dn = state[p + "down_proj"]  # [E, I, H]: input is I = dim 1
        state[p + "down_proj"] = roundtrip(dn.transpose(1, 2), GGMLType.MXFP4).transpose(1, 2).contiguous()


def gpt_oss_config(hf_config: Any) -> GptOssConfig:
    """Our config from an HF GptOssConfig: the one place HF's names map onto ours."""
    c = hf_config
    # Newer transformers keep rope_theta and the YaRN fields in rope_parameters; older ones in
    # rope_scaling plus a rope_theta attribute (HF's default 150000): read whichever this one has.
    rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    yarn = rope.get("rope_type", rope.get("type")) == "yarn"
    return GptOssConfig(
        n_layers=c.num_hidden_layers,
        hidden=c.hidden_size,
        n_heads=c.num_attention_heads,
        n_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        n_experts=c.num_local_experts,
        n_experts_used=c.num_experts_per_tok,
        expert_ffn=c.intermediate_size,
        vocab_size=c.vocab_size,
        context_length=c.max_position_embeddings,
        sliding_window=c.sliding_window,
        rms_eps=float(c.rms_norm_eps),
        rope_theta=float(rope.get("rope_theta", getattr(c, "rope_theta", 150000.0))),
        rope_scaling_factor=float(rope["factor"]) if yarn else 1.0,
        rope_original_ctx=int(rope["original_max_position_embeddings"]) if yarn else DEFAULT_ROPE_ORIGINAL_CTX,
        yarn_beta_fast=float(rope.get("beta_fast", DEFAULT_YARN_BETA_FAST)),
        yarn_beta_slow=float(rope.get("beta_slow", DEFAULT_YARN_BETA_SLOW)),
    )


def gpt_oss_metadata(hf_config: Any, tokenizer_meta: Mapping[str, Any], name: str = "gpt-oss") -> dict[str, Any]:
    """GGUF metadata (llama.cpp's key names and value types) from an HF GptOssConfig."""
    meta: dict[str, Any] = {
        "general.architecture": ARCH,
        "general.type": "model",
        "general.name": name,
        "general.file_type": 38,
        "general.quantization_version": 2,
        **gpt_oss_config(hf_config).to_metadata(),
    }
    meta.update(tokenizer_meta)
    return meta


# HF attention projection names and their GGUF (llama.cpp) names.
ATTN_PROJ_NAMES = (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output"))


def hf_to_gguf_tensors(
    state: Mapping[str, torch.Tensor],
    n_layers: int,
    *,
    dense_type: GGMLType = GGMLType.F32,
    expert_type: GGMLType = GGMLType.MXFP4,
    embed_type: GGMLType | None = None,
    type_for: Callable[[str, tuple[int, ...]], GGMLType] | None = None,
) -> list[TensorSpec]:
    """HF GptOss state_dict -> TensorSpecs. Norms, biases, sinks and the router stay F32
    (llama.cpp never quantizes them); attention, embedding and head use `dense_type`, experts
    `expert_type`, unless `type_for(gguf_name, ne)` names each quantized tensor's type (a
    llama-quantize mix, e.g. quant_mix.type_for)."""
    embed_type = dense_type if embed_type is None else embed_type
    specs: list[TensorSpec] = []

    def add(name: str, arr: np.ndarray, t: GGMLType | None = None) -> None:
        """t None: a tensor llama.cpp keeps F32; else this quantizable tensor's default type."""
        ne = tuple(reversed(arr.shape))
        t = GGMLType.F32 if t is None else type_for(name, ne) if type_for is not None else t
        specs.append(TensorSpec(name, t, ne, encode(arr, t)))

    add("token_embd.weight", _np(state["model.embed_tokens.weight"]), embed_type)
    for i in range(n_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", _np(state[p + "input_layernorm.weight"]))
        for hf, gg in ATTN_PROJ_NAMES:
            add(b + gg + ".weight", _np(state[p + f"self_attn.{hf}.weight"]), dense_type)
            add(b + gg + ".bias", _np(state[p + f"self_attn.{hf}.bias"]))
        add(b + "attn_sinks.weight", _np(state[p + "self_attn.sinks"]))
        add(b + "post_attention_norm.weight", _np(state[p + "post_attention_layernorm.weight"]))
        add(b + "ffn_gate_inp.weight", _np(state[p + "mlp.router.weight"]))
        add(b + "ffn_gate_inp.bias", _np(state[p + "mlp.router.bias"]))
        gu = _np(state[p + "mlp.experts.gate_up_proj"])  # [E, H, 2I]
        gub = _np(state[p + "mlp.experts.gate_up_proj_bias"])  # [E, 2I]
        add(b + "ffn_gate_exps.weight", np.ascontiguousarray(gu[:, :, 0::2].transpose(0, 2, 1)), expert_type)
        add(b + "ffn_up_exps.weight", np.ascontiguousarray(gu[:, :, 1::2].transpose(0, 2, 1)), expert_type)
        add(b + "ffn_gate_exps.bias", np.ascontiguousarray(gub[:, 0::2]))
        add(b + "ffn_up_exps.bias", np.ascontiguousarray(gub[:, 1::2]))
        dn = _np(state[p + "mlp.experts.down_proj"])  # [E, I, H]
        add(b + "ffn_down_exps.weight", np.ascontiguousarray(dn.transpose(0, 2, 1)), expert_type)
        add(b + "ffn_down_exps.bias", _np(state[p + "mlp.experts.down_proj_bias"]))
    add("output_norm.weight", _np(state["model.norm.weight"]))
    add("output.weight", _np(state["lm_head.weight"]), dense_type)
    return specs


def gguf_to_hf_state(tensor: Callable[[str], torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """The inverse of hf_to_gguf_tensors: GGUF tensors (dequantized, in GGUF's [rows, cols] order, by
    name) -> a GptOssForCausalLM state_dict (gate/up re-interleaved, experts [E, H, 2I])."""
    t = tensor
    sd = {"model.embed_tokens.weight": t("token_embd.weight"), "model.norm.weight": t("output_norm.weight"),
          "lm_head.weight": t("output.weight")}
    for i in range(n_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        sd[p + "input_layernorm.weight"] = t(b + "attn_norm.weight")
        sd[p + "post_attention_layernorm.weight"] = t(b + "post_attention_norm.weight")
        for hf, gg in ATTN_PROJ_NAMES:
            sd[p + f"self_attn.{hf}.weight"] = t(b + gg + ".weight")
            sd[p + f"self_attn.{hf}.bias"] = t(b + gg + ".bias")
        sd[p + "self_attn.sinks"] = t(b + "attn_sinks.weight")
        sd[p + "mlp.router.weight"] = t(b + "ffn_gate_inp.weight")
        sd[p + "mlp.router.bias"] = t(b + "ffn_gate_inp.bias")
        gate, up = t(b + "ffn_gate_exps.weight"), t(b + "ffn_up_exps.weight")  # [E, I, H]
        gu = torch.stack([gate, up], dim=2).flatten(1, 2)  # [E, 2I, H], rows gate0, up0, gate1, ...
        sd[p + "mlp.experts.gate_up_proj"] = gu.transpose(1, 2).contiguous()  # HF [E, H, 2I]
        sd[p + "mlp.experts.gate_up_proj_bias"] = torch.stack(
            [t(b + "ffn_gate_exps.bias"), t(b + "ffn_up_exps.bias")], dim=-1).flatten(1)
        sd[p + "mlp.experts.down_proj"] = t(b + "ffn_down_exps.weight").transpose(1, 2).contiguous()  # [E, I, H]
        sd[p + "mlp.experts.down_proj_bias"] = t(b + "ffn_down_exps.bias")
    return sd
