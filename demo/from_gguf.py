"""Read a demo GGUF back into training form: the HF GptOss state_dict and the exact tokenizer.

The inverse of export.py (`hybridmoe.convert.hf_to_gguf_tensors` + `tokenizer_metadata`), used to
warm-start training from the committed demo.gguf: weights are dequantized with the project's own
`hybridmoe.quant.formats.dequantize`, and the tokenizer is rebuilt from the GGUF vocabulary and merges
so that token ids match the file exactly (a warm start with other ids would be meaningless).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, models

from hybridmoe.gguf.constants import GGMLType
from hybridmoe.gguf.reader import ModelFile, open_model
from hybridmoe.quant.formats import dequantize
from hybridmoe.tokenizer.tokenizer import TOKEN_CONTROL
from tokenizer import new_tokenizer


def _tensor(m: ModelFile, name: str) -> np.ndarray:
    info = m.info(name)
    if info.ggml_type == GGMLType.F32:
        return np.array(m.array(name), dtype=np.float32).reshape(info.shape)
    return dequantize(np.asarray(m.raw(name)), info.ggml_type).reshape(info.shape)


def hf_state_from_gguf(path: Path, n_layers: int) -> dict[str, torch.Tensor]:
    """GGUF tensors -> GptOssForCausalLM state_dict (gate/up re-interleaved, experts [E, H, 2I])."""
    with open_model(path) as m:
        def t(name: str) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(_tensor(m, name)))

        sd = {"model.embed_tokens.weight": t("token_embd.weight"), "model.norm.weight": t("output_norm.weight"),
              "lm_head.weight": t("output.weight")}
        for i in range(n_layers):
            p, b = f"model.layers.{i}.", f"blk.{i}."
            sd[p + "input_layernorm.weight"] = t(b + "attn_norm.weight")
            for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
                sd[p + f"self_attn.{hf}.weight"] = t(b + gg + ".weight")
                sd[p + f"self_attn.{hf}.bias"] = t(b + gg + ".bias")
            sd[p + "self_attn.sinks"] = t(b + "attn_sinks.weight")
            sd[p + "post_attention_layernorm.weight"] = t(b + "post_attention_norm.weight")
            sd[p + "mlp.router.weight"] = t(b + "ffn_gate_inp.weight")
            sd[p + "mlp.router.bias"] = t(b + "ffn_gate_inp.bias")
            gate, up = t(b + "ffn_gate_exps.weight"), t(b + "ffn_up_exps.weight")  # [E, I, H]
            e, inter, hidden = gate.shape
            gu = torch.empty(e, hidden, 2 * inter)
            gu[:, :, 0::2], gu[:, :, 1::2] = gate.transpose(1, 2), up.transpose(1, 2)
            sd[p + "mlp.experts.gate_up_proj"] = gu
            gub = torch.empty(e, 2 * inter)
            gub[:, 0::2], gub[:, 1::2] = t(b + "ffn_gate_exps.bias"), t(b + "ffn_up_exps.bias")
            sd[p + "mlp.experts.gate_up_proj_bias"] = gub
            sd[p + "mlp.experts.down_proj"] = t(b + "ffn_down_exps.weight").transpose(1, 2).contiguous()  # [E, I, H]
            sd[p + "mlp.experts.down_proj_bias"] = t(b + "ffn_down_exps.bias")
    return sd


def tokenizer_from_gguf(path: Path) -> Tokenizer:
    """The byte-level BPE of a demo GGUF as a `tokenizers` Tokenizer with identical ids."""
    with open_model(path) as m:
        tokens = list(m.metadata["tokenizer.ggml.tokens"])
        types = list(m.metadata["tokenizer.ggml.token_type"])
        merges = [tuple(s.split(" ", 1)) for s in m.metadata["tokenizer.ggml.merges"]]
    specials = [i for i, ty in enumerate(types) if ty == TOKEN_CONTROL]
    vocab = {text: i for i, text in enumerate(tokens)}
    tok = new_tokenizer()
    tok.model = models.BPE(vocab=vocab, merges=merges)
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in specials])
    for i in specials:
        assert tok.token_to_id(tokens[i]) == i, tokens[i]
    return tok
