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

from hybridmoe.convert import gguf_to_hf_state
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

        return gguf_to_hf_state(t, n_layers)


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
