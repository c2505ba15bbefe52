"""Tokenizer from GGUF metadata, synthetic vocabularies, harmony parsing and chat templates."""

from .chat_template import ChatTemplateError, render_chat
from .harmony import Event, HarmonyParser, ParsedOutput, ToolCall, parse_completion, render_reasoning_none
from .tokenizer import IncrementalDecoder, Tokenizer

__all__ = [
    "ChatTemplateError",
    "Event",
    "HarmonyParser",
    "IncrementalDecoder",
    "ParsedOutput",
    "Tokenizer",
    "ToolCall",
    "parse_completion",
    "render_chat",
    "render_reasoning_none",
]
