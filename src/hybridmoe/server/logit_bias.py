"""`logit_bias` in both forms clients send: OpenAI's object {"token id": bias} and llama-server's
list of [token, bias] pairs, where a token may also be text (each of its tokens gets the bias) and
a bias of false bans the token. Unlike llama-server, which skips entries it cannot read, a bad
entry is a 400 naming it: a ban that silently does nothing is worse than an error."""

from __future__ import annotations

import math
from typing import Any

from hybridmoe.server.protocol import bad_request

MAX_ENTRIES = 4096  # far above what a client sends (OpenAI accepts 300 or so)
MAX_TEXT_CHARS = 1024  # a text entry is tokenized on the request's task: keep that short


def resolve_logit_bias(value: Any, encode: Any, n_vocab: int) -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs, in the order given (-inf: banned). `encode(text)` -> token ids."""
    if value is None:
        return ()
    if isinstance(value, dict):
        entries = [(k, v, f"logit_bias[{k!r}]") for k, v in value.items()]
    elif isinstance(value, list):
        entries = []
        for i, pair in enumerate(value):
            if not isinstance(pair, list) or len(pair) != 2:
                raise bad_request(f"logit_bias[{i}] must be a [token, bias] pair, got {pair!r}", param="logit_bias")
            entries.append((pair[0], pair[1], f"logit_bias[{i}]"))
    else:
        raise bad_request("logit_bias must be an object {token: bias} or a list of [token, bias] pairs",
                          param="logit_bias")
    if len(entries) > MAX_ENTRIES:
        raise bad_request(f"logit_bias has {len(entries)} entries; at most {MAX_ENTRIES} are accepted",
                          param="logit_bias")
    out: list[tuple[int, float]] = []
    for token, bias, where in entries:
        b = _bias(bias, where)
        for t in _tokens(token, encode, n_vocab, where):
            out.append((t, b))
            if len(out) > MAX_ENTRIES:
                raise bad_request(f"logit_bias names more than {MAX_ENTRIES} tokens", param="logit_bias")
    return tuple(out)


def _bias(v: Any, where: str) -> float:
    if v is False:
        return -math.inf
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    raise bad_request(f"{where}: the bias must be a finite number or false (ban), got {v!r}", param="logit_bias")


def _tokens(token: Any, encode: Any, n_vocab: int, where: str) -> list[int]:
    """A token id (an int, or an object key that is one), else text: the ids it tokenizes to."""
    digits = token.strip().removeprefix("-") if isinstance(token, str) else ""
    if digits.isascii() and digits.isdigit():
        token = int(token)
    if isinstance(token, int) and not isinstance(token, bool):
        if not 0 <= token < n_vocab:
            raise bad_request(f"{where}: token id {token} is outside the vocabulary (0..{n_vocab - 1})",
                              param="logit_bias")
        return [token]
    if isinstance(token, str):
        if len(token) > MAX_TEXT_CHARS:
            raise bad_request(f"{where}: a text of {len(token)} characters; at most {MAX_TEXT_CHARS}",
                              param="logit_bias")
        ids = encode(token)
        if not ids:
            raise bad_request(f"{where}: the text {token!r} has no tokens", param="logit_bias")
        return ids
    raise bad_request(f"{where}: the token must be an id or a text, got {token!r}", param="logit_bias")
