"""A toy byte-level vocabulary for constrained-decoding tests: every byte is a token, plus a few
multi-byte pieces, one special token and an end token, shaped like tokenizer.Tokenizer as far as
engine.constraints reads it."""

from __future__ import annotations

import torch

from hybridmoe.engine.constraints import GrammarConstraint, compile_constraint, make_constraint, token_table

PIECES = [b'{"', b'": ', b'", "', b"}}", b"true", b"12", b" ]", b"\\u00", b"1. ", b"e4", b"\n- ", b"O-O", b"=("]


class ByteTokenizer:
    def __init__(self) -> None:
        self.tokens = [bytes([b]) for b in range(256)] + PIECES + [b"<|special|>", b"<|end|>"]
        self.special = len(self.tokens) - 2
        self.end = len(self.tokens) - 1
        self.vocab_size = len(self.tokens)
        self.special_ids = frozenset({self.special, self.end})
        self.eog_ids = frozenset({self.end})
        self.eos_id, self.bos_id = self.end, None

    def token_bytes(self, i: int) -> bytes:
        return self.tokens[i]

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        return list(text.encode("utf-8"))


VOCAB = ByteTokenizer()


def constraint(spec, tok: ByteTokenizer = VOCAB) -> GrammarConstraint:
    """A fresh constraint for `spec` on the toy vocabulary, ending with its end token."""
    table = token_table(tok)
    c = make_constraint(compile_constraint(spec, table), table, frozenset({tok.end}))
    assert c is not None
    return c


def feeds(spec, data: bytes) -> bool:
    """Feed `data` byte by byte; True if every byte was allowed (mask and advance agree) and the
    text is complete at the end."""
    c = constraint(spec)
    for b in data:
        if not bool(c.mask()[b]):
            return False
        c.advance(b)
    return c.done and bool(c.mask()[VOCAB.end])


def admits_prefix(spec, data: bytes) -> bool:
    """`data` is a prefix of a text the spec admits (each byte allowed in turn)."""
    c = constraint(spec)
    for b in data:
        if not bool(c.mask()[b]):
            return False
        c.advance(b)
    return True


def random_logits(gen: torch.Generator, end_boost: float = 6.0) -> torch.Tensor:
    """What a model that wants anything gives; the end token likely, so the constraint must hold it back."""
    logits = torch.randn(VOCAB.vocab_size, generator=gen) * 4
    logits[VOCAB.end] += end_boost
    return logits
