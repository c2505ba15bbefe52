"""What the server says about a loaded model (/v1/models, /props, templates), as plain data.

The names follow llama.cpp's: its number for the tokenizer model and its name for
`general.file_type`, so a client that reads llama-server's answers reads ours the same way.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from hybridmoe.gguf.reader import ModelFile
from hybridmoe.gpt_oss_config import GptOssConfig

# llama.h: enum llama_vocab_type, and the LLAMA_FTYPE_* values a gpt-oss file can carry
VOCAB_TYPES = {"no_vocab": 0, "llama": 1, "gpt2": 2, "bert": 3, "t5": 4, "rwkv": 5, "plamo2": 6}
FILE_TYPE_NAMES = {0: "all F32", 1: "F16", 7: "Q8_0", 32: "BF16", 38: "MXFP4 MoE"}


@dataclass(frozen=True)
class ModelInfo:
    path: str
    chat_template: str | None  # the file's tokenizer.chat_template (Jinja), if it has one
    vocab_size: int
    n_ctx_train: int
    n_embd: int
    n_params: int
    size_bytes: int
    vocab_type: int | None = None  # llama.cpp's number for tokenizer.ggml.model (gpt2 BPE: 2)
    ftype: str | None = None  # llama.cpp's name for general.file_type ("MXFP4 MoE"), when known


def describe_model(path: str, model_file: ModelFile, config: GptOssConfig) -> ModelInfo:
    """The model's description from its file: sizes counted from the tensor table and the files."""
    meta = model_file.metadata
    return ModelInfo(
        path=path,
        chat_template=meta.get("tokenizer.chat_template"),
        vocab_size=config.vocab_size,
        n_ctx_train=config.context_length,
        n_embd=config.hidden,
        n_params=sum(math.prod(t.ne) for t in model_file.tensors.values()),
        size_bytes=sum(os.path.getsize(f.path) for f in model_file.files),
        vocab_type=VOCAB_TYPES.get(str(meta.get("tokenizer.ggml.model"))),
        ftype=FILE_TYPE_NAMES.get(meta.get("general.file_type")),
    )
