"""DRY ("don't repeat yourself"), llama.cpp's penalty on tokens that would extend a repeat: when the
text's last L tokens already occurred earlier, followed there by token t, then t's logit loses
multiplier * base^(L - allowed_length) (L at least allowed_length). A repeat does not reach back
across a sequence breaker (by default a newline, ':', '"' or '*'), and a token that is itself a
breaker is never penalized. Rules as llama.cpp's src/llama-sampler.cpp (docs/sampling.md)."""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

MAX_BREAKER_CHARS = 40  # llama.cpp truncates a breaker to 40 characters
MAX_BREAKER_TAIL = 20  # and a breaker's tail to 20 tokens
FLOAT_MAX_LOG = 88.7228391  # log(FLT_MAX): the exponent is capped so the penalty stays finite

# head token -> tails: the tokens that must follow the head for the breaker to be complete ([]
# for a head that holds a whole breaker).
Breakers = dict[int, list[tuple[int, ...]]]


def breakers_for(texts: Sequence[str], pieces: Sequence[str], encode: Callable[[str], list[int]]) -> Breakers:
    """Each breaker text (truncated as llama.cpp does) as token sequences: every token whose text
    contains it is a head with no tail; a token whose text ends with a start of it is a head whose
    tail is the rest of the breaker, tokenized. `pieces`: every token's text, by id."""
    out: Breakers = {}
    for text in texts:
        text = text[:MAX_BREAKER_CHARS]
        if not text:
            continue
        for tid, word in enumerate(pieces):
            if text in word:
                _add(out, tid, ())
                continue
            pos = word.find(text[0])
            while pos >= 0:
                rest = word[pos:]
                if text.startswith(rest):
                    _add(out, tid, tuple(encode(text[len(rest):])[:MAX_BREAKER_TAIL]))
                pos = word.find(text[0], pos + 1)
    return out


def _add(out: Breakers, head: int, tail: tuple[int, ...]) -> None:
    tails = out.setdefault(head, [])
    if tail not in tails:
        tails.append(tail)


_cache: weakref.WeakKeyDictionary[object, dict[tuple[str, ...], Breakers]] = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def cached_breakers(tokenizer: object, texts: Sequence[str], pieces: Callable[[], Sequence[str]],
                    encode: Callable[[str], list[int]]) -> Breakers:
    """breakers_for, kept per tokenizer (while it lives) and breaker list, the last 64 lists (a
    scan of the vocabulary takes ~0.1 s for 200k tokens; clients send the same breakers)."""
    key = tuple(texts)
    with _cache_lock:
        hit = _cache.get(tokenizer, {}).get(key)
    if hit is None:
        hit = breakers_for(texts, pieces(), encode)
        with _cache_lock:
            lists = _cache.setdefault(tokenizer, {})
            if len(lists) >= 64:
                lists.pop(next(iter(lists)))
            lists[key] = hit
    return hit


def tokenizer_breakers(tokenizer: Any, texts: Sequence[str]) -> Breakers:
    """cached_breakers for one of our Tokenizers (token texts by id, plain-text encoding)."""
    return cached_breakers(
        tokenizer, texts,
        lambda: [tokenizer.token_bytes(i).decode("utf-8", "replace") for i in range(tokenizer.vocab_size)],
        lambda text: tokenizer.encode(text, allow_special=False))


class Dry:
    """The penalty's state for one request: the last `last_n` tokens (-1: all) of prompt and reply,
    in a growing numpy buffer. Each call costs a vectorized pass over the window plus work on the
    positions that match; the latest breaker is found incrementally, so a long context without
    breakers does not cost a Python loop per token (the engine thread samples every stream)."""

    def __init__(self, multiplier: float, base: float, allowed_length: int, last_n: int, breakers: Breakers):
        self.multiplier, self.base, self.allowed = multiplier, base, allowed_length
        self.breakers = breakers
        self.active = multiplier != 0.0 and base >= 1.0 and last_n != 0
        self.last_n = last_n
        self.max_exponent = int(FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0
        self._buf = np.zeros(256, dtype=np.int64)
        self._n = 0  # tokens accepted
        self._heads = np.array(sorted(breakers), dtype=np.int64)
        self._scanned = 0  # positions before this were looked at for breaker heads
        self._anchor: tuple[int, int] | None = None  # latest head with a complete breaker: (position, tail length)

    @property
    def maxlen(self) -> int | None:
        """The window's length (None: all tokens)."""
        return None if self.last_n < 0 else self.last_n

    def accept(self, token: int) -> None:
        if not self.active:
            return
        if self._n == len(self._buf):
            self._buf = np.concatenate([self._buf, np.zeros_like(self._buf)])
        self._buf[self._n] = token
        self._n += 1

    def accept_all(self, tokens: list[int]) -> None:
        """The prompt at once: only the window's tail is kept."""
        if not self.active or not tokens:
            return
        tail = np.asarray(tokens if self.last_n < 0 else tokens[-self.last_n:], dtype=np.int64)
        if self._n + len(tail) > len(self._buf):
            grown = np.zeros(max(2 * len(self._buf), self._n + len(tail)), dtype=np.int64)
            grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        self._buf[self._n : self._n + len(tail)] = tail
        self._n += len(tail)

    def penalties(self) -> dict[int, float]:
        """token id -> what its logit loses now."""
        if not self.active:
            return {}
        start = 0 if self.last_n < 0 else max(0, self._n - self.last_n)
        t = self._buf[start : self._n]
        n = len(t)
        if n <= self.allowed:
            return {}
        limit = self._repeat_limit(start, n)
        if limit < self.allowed:
            return {}
        # match[j]: how many tokens ending at position j equal the text's last ones (at most
        # limit); the token after j would extend that repeat.
        match = np.zeros(n - 1, dtype=np.int64)
        alive = np.nonzero(t[: n - 1] == t[n - 1])[0]
        length = 0
        while alive.size and length < limit:
            length += 1
            match[alive] = length
            nxt = alive - length
            ok = nxt >= 0
            alive, nxt = alive[ok], nxt[ok]
            alive = alive[t[nxt] == t[n - 1 - length]]
        worst: dict[int, int] = {}
        for j in np.nonzero(match >= self.allowed)[0].tolist():
            tok = int(t[j + 1])
            worst[tok] = max(worst.get(tok, 0), int(match[j]))
        out: dict[int, float] = {}
        for tok, length in worst.items():
            if () in self.breakers.get(tok, ()):
                continue  # a token that is a whole breaker is never penalized
            e = length - self.allowed
            if self.max_exponent > 0:
                e = min(e, self.max_exponent)
            out[tok] = self.multiplier * self.base**e
        return out

    def _repeat_limit(self, start: int, n: int) -> int:
        """How far a repeat may reach back: to just after the latest complete breaker in the
        window (its head at distance i from the end, its tail of length k: i - k)."""
        self._scan()
        if self._anchor is None or self._anchor[0] < start:
            return n
        p, k = self._anchor
        return (self._n - 1 - p) - k

    def _scan(self) -> None:
        """Look for breaker heads among the new positions, and again among the last
        MAX_BREAKER_TAIL ones (whose tails may have completed since)."""
        if not len(self._heads):
            return
        lo = max(0, self._scanned - MAX_BREAKER_TAIL)
        seg = self._buf[lo : self._n]
        for off in np.nonzero(np.isin(seg, self._heads))[0].tolist():
            p = lo + off
            longest = -1
            for tail in self.breakers[int(self._buf[p])]:
                k = len(tail)
                if longest < k and p + k <= self._n - 1 and all(tail[o] == self._buf[p + 1 + o] for o in range(k)):
                    longest = k
            if longest >= 0 and (self._anchor is None or p >= self._anchor[0]):
                self._anchor = (p, longest)
        self._scanned = self._n
