"""GGUF files: our own memmap reader and a streaming/sparse writer (numpy only, no torch)."""

from hybridmoe.gguf.constants import GGMLType, GGUFValueType, Keys, block_bytes, block_elems
from hybridmoe.gguf.errors import GGUFError
from hybridmoe.gguf.reader import GGUFFile, ModelFile, TensorInfo, open_model
from hybridmoe.gguf.writer import TensorSpec, write_gguf, write_split

__all__ = ["GGMLType", "GGUFValueType", "Keys", "block_bytes", "block_elems", "GGUFError",
           "GGUFFile", "ModelFile", "TensorInfo", "open_model", "TensorSpec", "write_gguf",
           "write_split"]
