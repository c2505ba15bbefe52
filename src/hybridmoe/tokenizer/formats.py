"""The table of chat formats, most specific first, and the choice made once at load."""

from __future__ import annotations

from .chat_format import ChatFormat
from .harmony import HarmonyFormat
from .plain_format import PlainFormat
from .tokenizer import Tokenizer

FORMATS = (HarmonyFormat, PlainFormat)  # PlainFormat matches every template: the fallback


def choose_format(template: str, tok: Tokenizer) -> ChatFormat:
    """The first format in FORMATS that the template and the vocabulary fit."""
    return next(f(tok) for f in FORMATS if f.matches(template, tok))
