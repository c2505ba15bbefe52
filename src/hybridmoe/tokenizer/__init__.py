"""Tokenizer from GGUF metadata, synthetic vocabularies, harmony parsing and chat templates."""

from .tokenizer import IncrementalDecoder, Tokenizer

__all__ = ["IncrementalDecoder", "Tokenizer"]
