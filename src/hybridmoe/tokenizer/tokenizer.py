"""Byte-level BPE tokenizer built from a GGUF file's own `tokenizer.ggml.*` metadata.

Encoding runs in the `tokenizers` library (Rust); decoding is done here from a per-id byte table so
that streaming decode can work on raw bytes and hold back incomplete UTF-8.
"""

from __future__ import annotations

import codecs
import itertools
import operator
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from .harmony import generation_end_ids

# GGUF `tokenizer.ggml.token_type` values (llama.cpp llama_token_type).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

# Pre-tokenizer split patterns by `tokenizer.ggml.pre`. o200k (gpt-4o) digits go in groups of 1-3.
O200K_PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
PRE_PATTERNS = {"gpt-4o": O200K_PATTERN, "default": GPT2_PATTERN, "gpt2": GPT2_PATTERN}

def bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to chr(256 + k)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_CHAR = bytes_to_unicode()
# str.translate table: byte-level char -> latin-1 char of the byte, then .encode("latin-1").
_CHAR_TO_LATIN1 = {ord(c): b for b, c in BYTE_TO_CHAR.items()}
# The same map as an array indexed by code point (-1: not in the byte-level alphabet).
_CP_TO_BYTE = np.full(max(_CHAR_TO_LATIN1) + 1, -1, np.int16)
_CP_TO_BYTE[list(_CHAR_TO_LATIN1)] = list(_CHAR_TO_LATIN1.values())


def byte_level_encode(data: bytes) -> str:
    """Raw bytes -> GPT-2 byte-level token string (the form stored in `tokenizer.ggml.tokens`)."""
    return "".join(BYTE_TO_CHAR[b] for b in data)


def byte_level_decode(token: str) -> bytes:
    """GPT-2 byte-level token string -> raw bytes; ValueError if it holds a char outside the alphabet."""
    try:
        return token.translate(_CHAR_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError as e:
        raise ValueError(f"token {token!r} is not GPT-2 byte-level encoded ({e.reason})") from None


def _require(meta: Mapping[str, Any], key: str) -> Any:
    if key not in meta:
        raise ValueError(f"tokenizer metadata is missing required key {key!r}")
    return meta[key]


def _optional_id(meta: Mapping[str, Any], key: str, n_vocab: int) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    value = int(value)
    if not 0 <= value < n_vocab:
        raise ValueError(f"{key} = {value} is outside the vocabulary [0, {n_vocab})")
    return value


class Tokenizer:
    """Tokenizer for GGUF `tokenizer.ggml.model == "gpt2"` (byte-level BPE) vocabularies."""

    def __init__(
        self,
        tokens: Sequence[str],
        token_types: Sequence[int],
        merges: Sequence[str],
        pre: str,
        bos_id: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        extra_eos_ids: Iterable[int] = (),
    ) -> None:
        if len(token_types) != len(tokens):
            raise ValueError(
                f"tokenizer.ggml.token_type has {len(token_types)} entries "
                f"but tokenizer.ggml.tokens has {len(tokens)}"
            )
        if pre not in PRE_PATTERNS:
            raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r}; supported: {sorted(PRE_PATTERNS)}")
        self.pre = pre
        self._tokens = list(tokens)
        self._types = list(map(int, token_types))
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id

        types = np.asarray(self._types)
        self._special_ids = set(np.flatnonzero((types == TOKEN_CONTROL) | (types == TOKEN_USER_DEFINED)).tolist())
        self._control_ids = set(np.flatnonzero(types == TOKEN_CONTROL).tolist())
        # First occurrence wins on duplicate strings (built from the end so earlier ids overwrite).
        n = len(self._tokens)
        self._id_by_text = dict(zip(reversed(self._tokens), range(n - 1, -1, -1)))
        self._token_bytes = self._build_token_bytes()
        self._hf = self._build_hf(merges)
        # encode_special_tokens is a flag of a Rust tokenizer, so text-only encoding gets its own
        # copy (built on first use) instead of toggling a shared one under a lock.
        self._hf_plain: _HFTokenizer | None = None
        self._plain_lock = threading.Lock()
        # Fewest tokens a text can be: every token spells at most this many bytes (chars <= bytes).
        self.max_token_bytes = max(1, max(map(len, self._token_bytes)))
        # Pieces split before a space are exact only if no added token spans such a place.
        self._splittable = not any(" " in self._tokens[i] for i in self._special_ids)
        self.eog_ids = self._build_eog(extra_eos_ids)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from a GGUF metadata dict (keys `tokenizer.ggml.*`); ValueError on anything unsupported."""
        model = _require(meta, "tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(
                f"unsupported tokenizer.ggml.model {model!r}: only 'gpt2' (byte-level BPE) is implemented"
            )
        tokens = list(_require(meta, "tokenizer.ggml.tokens"))
        if not tokens:
            raise ValueError("tokenizer.ggml.tokens is empty")
        n = len(tokens)
        types = meta.get("tokenizer.ggml.token_type")
        types = [TOKEN_NORMAL] * n if types is None else list(types)
        merges = list(_require(meta, "tokenizer.ggml.merges"))
        extra = [int(i) for i in meta.get("tokenizer.ggml.eos_token_ids", None) or ()]
        for i in extra:
            if not 0 <= i < n:
                raise ValueError(f"tokenizer.ggml.eos_token_ids has {i}, outside the vocabulary [0, {n})")
        return cls(
            tokens,
            types,
            merges,
            pre=str(meta.get("tokenizer.ggml.pre", "default")),
            bos_id=_optional_id(meta, "tokenizer.ggml.bos_token_id", n),
            eos_id=_optional_id(meta, "tokenizer.ggml.eos_token_id", n),
            pad_id=_optional_id(meta, "tokenizer.ggml.padding_token_id", n),
            extra_eos_ids=extra,
        )

    def _build_token_bytes(self) -> list[bytes]:
        # Fast path (a 201k vocabulary in ~40 ms instead of ~200): map all tokens joined through
        # one array lookup (each byte-level char is one byte), then slice by length. Added tokens
        # (specials) are stored raw, not byte-level encoded.
        tokens = self._tokens
        cps = np.frombuffer("".join(tokens).encode("utf-32-le"), np.uint32)
        if cps.size == 0 or (cps.max() < _CP_TO_BYTE.size and (_CP_TO_BYTE[cps] >= 0).all()):
            blob = _CP_TO_BYTE[cps].astype(np.uint8).tobytes()
            offs = list(itertools.accumulate(map(len, tokens), initial=0))
            out = [blob[a:b] for a, b in zip(offs, offs[1:])]
            for i in self._special_ids:
                out[i] = tokens[i].encode("utf-8")
            return out
        blob = None  # some token is not byte-level (fine for specials); go token by token
        out: list[bytes] = []
        pos = 0
        for i, text in enumerate(tokens):
            end = pos + len(text)
            if i in self._special_ids:
                out.append(text.encode("utf-8"))
            elif blob is not None:
                out.append(blob[pos:end])
            else:
                try:
                    out.append(byte_level_decode(text))
                except ValueError as e:
                    raise ValueError(f"tokenizer.ggml.tokens[{i}]: {e}") from None
            pos = end
        return out

    def _build_hf(self, merges: Sequence[str]) -> _HFTokenizer:
        pairs = [tuple(m.split(" ")) for m in merges]
        if set(map(len, pairs)) - {2}:
            k = next(k for k, p in enumerate(pairs) if len(p) != 2)
            raise ValueError(f"tokenizer.ggml.merges[{k}] = {merges[k]!r} is not of the form 'A B'")
        # ignore_merges: a pre-token that is itself a vocabulary entry becomes that token directly,
        # as tiktoken does for o200k (rank lookup before merging).
        try:
            bpe = models.BPE(vocab=self._id_by_text, merges=pairs, ignore_merges=True)
        except Exception as e:  # the Rust side names the merge whose parts are not tokens
            raise ValueError(f"tokenizer.ggml.merges does not match tokenizer.ggml.tokens: {e}") from None
        tk = _HFTokenizer(bpe)
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(PRE_PATTERNS[self.pre]), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tk.decoder = decoders.ByteLevel()
        # Specials keep their exact ids because their content is already in the BPE vocab.
        added = [
            AddedToken(self._tokens[i], special=(self._types[i] == TOKEN_CONTROL), normalized=False)
            for i in sorted(self._special_ids)
            if self._id_by_text[self._tokens[i]] == i
        ]
        if added:
            tk.add_special_tokens(added)
        for tok in added:
            got = tk.token_to_id(tok.content)
            if got != self._id_by_text[tok.content]:
                want = self._id_by_text[tok.content]
                raise ValueError(f"special token {tok.content!r} got id {got}, expected {want}")
        return tk

    def _build_eog(self, extra: Iterable[int]) -> frozenset[int]:
        return generation_end_ids(self.token_id, self.eos_id, extra)

    # ---- queries ------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of CONTROL and USER_DEFINED tokens (matched whole in text, never produced by BPE)."""
        return frozenset(self._special_ids)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_id(self, text: str) -> int | None:
        """Id of the vocabulary entry spelled `text` (byte-level form for normal tokens), or None."""
        return self._id_by_text.get(text)

    def decoder(self) -> IncrementalDecoder:
        """A fresh streaming detokenizer over this vocabulary."""
        return IncrementalDecoder(self)

    def token_text(self, token_id: int) -> str:
        """The token's text: specials as written, others decoded (may hold U+FFFD)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self._token_bytes[self._check_id(token_id)]

    def _check_id(self, token_id: int) -> int:
        """The id as a Python int (numpy/torch integers accepted); ValueError if out of range."""
        try:
            i = operator.index(token_id)
        except TypeError:
            raise ValueError(f"token id must be an integer, got {type(token_id).__name__}") from None
        if isinstance(token_id, bool) or not 0 <= i < len(self._tokens):
            raise ValueError(f"token id {token_id!r} is outside the vocabulary [0, {len(self._tokens)})")
        return i

    # ---- encode / decode ----------------------------------------------------------------------
    def encode(self, text: str, allow_special: bool = True, max_tokens: int | None = None) -> list[int]:
        """Text -> ids. With allow_special, control/added token strings (special tokens) become their
        ids; without, they are encoded as ordinary text. No BOS is added.

        Long texts are encoded in pieces split where the pre-tokenizer always splits (same ids),
        in batch calls that release the GIL, so one long text does not stall other threads. With
        `max_tokens`, TokenLimitExceeded as soon as the text certainly has more tokens: first
        from its length alone, then after each batch (the work is bounded by the limit).
        """
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        if max_tokens is not None and len(text) > max_tokens * self.max_token_bytes:
            raise TokenLimitExceeded(max_tokens, -(-len(text) // self.max_token_bytes))
        hf = self._hf if allow_special else self._plain_tokenizer()
        if len(text) <= _PIECE_CHARS:
            return self._checked(hf.encode(text, add_special_tokens=False).ids, max_tokens)
        pieces = split_at_spaces(text, _PIECE_CHARS) if self._splittable else [text]
        ids: list[int] = []
        for k in range(0, len(pieces), _PIECES_PER_CALL):
            for enc in hf.encode_batch(pieces[k:k + _PIECES_PER_CALL], add_special_tokens=False):
                ids += enc.ids
            self._checked(ids, max_tokens)
        return ids

    @staticmethod
    def _checked(ids: list[int], max_tokens: int | None) -> list[int]:
        if max_tokens is not None and len(ids) > max_tokens:
            raise TokenLimitExceeded(max_tokens, len(ids))
        return ids

    def _plain_tokenizer(self) -> _HFTokenizer:
        """A copy of the Rust tokenizer that encodes special-token strings as ordinary text."""
        with self._plain_lock:
            if self._hf_plain is None:
                plain = _HFTokenizer.from_str(self._hf.to_str())
                plain.encode_special_tokens = True
                self._hf_plain = plain
            return self._hf_plain

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        parts = []
        for i in ids:
            i = self._check_id(i)
            if skip_special and i in self._control_ids:
                continue
            parts.append(self._token_bytes[i])
        return b"".join(parts)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Ids -> text; invalid UTF-8 becomes U+FFFD. skip_special drops CONTROL tokens."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")


class TokenLimitExceeded(ValueError):
    """The text has more than `limit` tokens (at least `at_least`; counting stopped early)."""

    def __init__(self, limit: int, at_least: int) -> None:
        super().__init__(f"the text has at least {at_least} tokens, more than the limit of {limit}")
        self.limit = limit
        self.at_least = at_least


# Texts longer than this are encoded in pieces of about this many characters, this many per call.
_PIECE_CHARS = 4096
_PIECES_PER_CALL = 16


def split_at_spaces(text: str, size: int) -> list[str]:
    """`text` cut into pieces of about `size` characters, each cut just before a space that follows
    a non-space character. Both pre-tokenizer patterns (o200k, gpt2) split there: a space enters a
    match only as its first character or inside a run of whitespace. A stretch without such a
    space stays whole."""
    pieces: list[str] = []
    start, n = 0, len(text)
    while n - start > size:
        cut = _cut_before(text, start + 1, start + size)
        if cut < 0:
            cut = _cut_after(text, start + size, n)
            if cut < 0:
                break
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _cut_before(text: str, lo: int, hi: int) -> int:
    """Last index i in [lo, hi] with text[i] == ' ' and text[i-1] not whitespace, else -1."""
    i = text.rfind(" ", lo, hi + 1)
    while i >= lo:
        if not text[i - 1].isspace():
            return i
        i = text.rfind(" ", lo, i)
    return -1


def _cut_after(text: str, lo: int, hi: int) -> int:
    """First such index in [lo, hi), else -1."""
    i = text.find(" ", lo, hi)
    while i >= 0:
        if not text[i - 1].isspace():
            return i
        i = text.find(" ", i + 1, hi)
    return -1


class IncrementalDecoder:
    """Streaming detokenizer: push ids one at a time, get only complete UTF-8 text back.

    The concatenation of all `push` results plus `flush()` equals `tok.decode(all_ids)`.
    """

    def __init__(self, tok: Tokenizer, skip_special: bool = False) -> None:
        self._tok = tok
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tok.decode_bytes((token_id,), self._skip_special))

    def flush(self) -> str:
        """Emit what is held back (an incomplete sequence becomes U+FFFD) and reset."""
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out
