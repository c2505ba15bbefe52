"""Tokenizer (GGUF byte-level BPE) and synthetic vocabulary tests.

The tokenizer is checked against a slow pure-Python reference: the o200k split regex run by the
`regex` module, then tiktoken-style rank BPE (whole piece in vocab -> one token; else merge the
leftmost lowest-rank pair until none applies).
"""

from __future__ import annotations

import random

import pytest
import regex

from hybridmoe.tokenizer import IncrementalDecoder, Tokenizer
from hybridmoe.tokenizer.synthetic import GPT_OSS_VOCAB, HARMONY_SPECIALS, make_vocab
from hybridmoe.tokenizer.tokenizer import (
    BYTE_TO_CHAR,
    GPT2_PATTERN,
    O200K_PATTERN,
    TOKEN_CONTROL,
    TOKEN_USER_DEFINED,
    byte_level_decode,
    byte_level_encode,
)


@pytest.fixture(scope="module")
def small_meta() -> dict:
    return make_vocab(3000, seed=1, preset="tiny")


@pytest.fixture(scope="module")
def small(small_meta) -> Tokenizer:
    return Tokenizer.from_metadata(small_meta)


@pytest.fixture(scope="module")
def big_meta() -> dict:
    return make_vocab(GPT_OSS_VOCAB, seed=0, preset="20b")


@pytest.fixture(scope="module")
def big(big_meta) -> Tokenizer:
    return Tokenizer.from_metadata(big_meta)


# ---------- slow reference encoder ----------
class RefBPE:
    def __init__(self, meta: dict, pattern: str = O200K_PATTERN) -> None:
        self.tokens = meta["tokenizer.ggml.tokens"]
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.ranks = {tuple(m.split(" ")): r for r, m in enumerate(meta["tokenizer.ggml.merges"])}
        types = meta["tokenizer.ggml.token_type"]
        self.specials = [t for t, k in zip(self.tokens, types) if k in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
        self.split = regex.compile(pattern)

    def bpe(self, piece: str) -> list[int]:
        word = byte_level_encode(piece.encode("utf-8"))
        if word in self.ids:
            return [self.ids[word]]
        parts = list(word)
        while len(parts) > 1:
            ranked = [(self.ranks.get((a, b), 1 << 60), k) for k, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, k = min(ranked)
            if rank == 1 << 60:
                break
            parts[k : k + 2] = [parts[k] + parts[k + 1]]
        return [self.ids[p] for p in parts]

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        chunks = [text]
        if allow_special and self.specials:
            alternation = "|".join(regex.escape(s) for s in sorted(self.specials, key=len, reverse=True))
            chunks = regex.split(f"({alternation})", text)
        out: list[int] = []
        for k, chunk in enumerate(chunks):
            if k % 2 == 1:
                out.append(self.ids[chunk])
            else:
                for piece in self.split.findall(chunk):
                    out.extend(self.bpe(piece))
        return out


# Pieces for random text: ASCII words, digits, whitespace runs, Latin/CJK/emoji/combining marks.
_PIECES = [
    "Hello", " world", "the", " quick", "answer", "12", "3456789", "007", " ", "  ", "\t", "\n", "\r\n", "\n\n  ",
    "don't", "I'LL", "café", "naïve", "日本語", "你好", "한국어", "Привет", "مرحبا", "🙂", "👩‍👩‍👧", "🇫🇷",
    "e\u0301", "a\u0308\u0323", "ß", "…", "—", "$1,234.56", "<html>", "x+y=z", "_under_", "/path/to",
    "\u00a0", "\u3000", "\ufeff", "<|start|>", "<|", "|>",
]


def random_text(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.6:
            out.append(rng.choice(_PIECES))
        elif r < 0.8:
            out.append(chr(rng.randrange(0x20, 0x2FF)))
        elif r < 0.95:
            cp = rng.randrange(0x100, 0x10FFFF)
            if not 0xD800 <= cp < 0xE000:
                out.append(chr(cp))
        else:
            # bytes-as-text: latin-1 view of random bytes
            out.append(bytes(rng.randrange(256) for _ in range(rng.randint(1, 5))).decode("latin-1"))
    return "".join(out)


# ---------- byte-level alphabet ----------
def test_byte_level_alphabet_is_a_bijection():
    assert len(set(BYTE_TO_CHAR.values())) == 256
    data = bytes(range(256))
    assert byte_level_decode(byte_level_encode(data)) == data
    assert BYTE_TO_CHAR[ord(" ")] == "\u0120"  # 'Ġ', the familiar GPT-2 space
    with pytest.raises(ValueError, match="byte-level"):
        byte_level_decode("\u4e00")


# ---------- encode / decode ----------
@pytest.mark.parametrize("seed", range(6))
def test_round_trip_random_utf8(small, seed):
    rng = random.Random(seed)
    for _ in range(20):
        text = random_text(rng, rng.randint(1, 30))
        assert small.decode(small.encode(text, allow_special=False)) == text
        assert small.decode(small.encode(text)) == text


@pytest.mark.parametrize("seed", range(4))
def test_encode_matches_reference_bpe(small_meta, small, seed):
    ref = RefBPE(small_meta)
    rng = random.Random(100 + seed)
    for _ in range(25):
        text = random_text(rng, rng.randint(1, 25))
        assert small.encode(text, allow_special=False) == ref.encode(text, allow_special=False), text
        assert small.encode(text) == ref.encode(text), text


def test_digits_split_in_groups_of_at_most_three(small):
    ids = small.encode("1234567")
    pieces = [small.token_text(i) for i in ids]
    assert "".join(pieces) == "1234567"
    cuts, pos = set(), 0
    for p in pieces:
        pos += len(p)
        cuts.add(pos)
    assert {3, 6, 7} <= cuts  # "123" "456" "7": no token crosses a group boundary


def test_common_english_is_compact(small, big):
    for tok in (small, big):
        assert len(tok.encode("Hello world")) <= 3
        assert len(tok.encode("The quick brown fox jumps over the lazy dog.")) <= 12


def test_gpt2_pre_tokenizer(small_meta):
    meta = dict(small_meta, **{"tokenizer.ggml.pre": "gpt2"})
    tok = Tokenizer.from_metadata(meta)
    ref = RefBPE(meta, GPT2_PATTERN)
    rng = random.Random(7)
    for _ in range(20):
        text = random_text(rng, 15)
        assert tok.encode(text, allow_special=False) == ref.encode(text, allow_special=False)
    # GPT-2 keeps digit runs together in one pre-token; o200k caps them at 3
    assert ref.split.findall("123456") == ["123456"]


def test_whole_piece_in_vocab_wins_over_merges():
    # tiktoken semantics: "abc" is a token but no merge path reaches it; it must still be used whole.
    tokens = [BYTE_TO_CHAR[b] for b in range(256)] + ["bc", "abc", "<|end|>"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-4o",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * 258 + [TOKEN_CONTROL],
        "tokenizer.ggml.merges": ["b c"],
    }
    tok = Tokenizer.from_metadata(meta)
    assert tok.encode("abc") == [257]
    assert tok.encode("abcd") == [ord("a"), 256, ord("d")]
    assert tok.encode("abc<|end|>") == [257, 258]
    assert tok.eog_ids == set()


@pytest.mark.slow  # importing transformers takes several seconds
def test_matches_transformers_gguf_tokenizer(small_meta, small):
    # transformers builds its own tokenizer from the same GGUF keys: an independent construction
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    fields = {"tokens": "tokens", "token_type": "token_type", "merges": "merges"}
    d = {name: small_meta[f"tokenizer.ggml.{key}"] for key, name in fields.items()}
    d.update(tokenizer_type="gpt2", pre_tokenizer_type="gpt-4o")
    hf, _ = mapping.convert_gguf_tokenizer("gpt-oss", d)
    rng = random.Random(11)
    for _ in range(100):
        text = random_text(rng, 20)
        assert small.encode(text) == hf.encode(text, add_special_tokens=False).ids, text


# ---------- specials ----------
def test_specials_at_gpt_oss_ids(big):
    assert big.vocab_size == GPT_OSS_VOCAB
    for tid, name in HARMONY_SPECIALS.items():
        assert big.token_id(name) == tid
        assert big.token_text(tid) == name
        assert big.encode(name) == [tid]
    assert big.token_id("<|reserved_200013|>") == 200013
    assert big.token_id("<|reserved_201087|>") == 201087
    assert (big.bos_id, big.eos_id, big.pad_id) == (199998, 200002, 199999)


def test_specials_in_text(big):
    text = "<|start|>assistant<|channel|>final<|message|>Hi <|end|>"
    ids = big.encode(text)
    assert ids[0] == 200006 and 200005 in ids and 200008 in ids and ids[-1] == 200007
    assert big.decode(ids) == text
    plain = big.encode(text, allow_special=False)
    assert not set(plain) & big.special_ids
    assert big.decode(plain) == text
    assert big.decode(ids, skip_special=True) == "assistantfinalHi "


def test_eog_ids(big, small_meta):
    assert big.eog_ids == {200002, 200012, 199999}
    assert 200007 not in big.eog_ids
    # eos set to <|end|> by some converter and an explicit eos_token_ids list
    small = Tokenizer.from_metadata(small_meta)
    end = small.token_id("<|end|>")
    meta = dict(small_meta, **{"tokenizer.ggml.eos_token_id": end, "tokenizer.ggml.eos_token_ids": [5]})
    tok = Tokenizer.from_metadata(meta)
    assert end not in tok.eog_ids
    assert {5, tok.token_id("<|return|>"), tok.token_id("<|call|>")} <= tok.eog_ids


def test_eog_plain_vocab_is_just_eos(small_meta):
    # without harmony names the eos id alone ends generation
    meta = dict(small_meta)
    n = len(meta["tokenizer.ggml.tokens"])
    meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"][: n - 16] + [f"<|x{k}|>" for k in range(16)]
    meta["tokenizer.ggml.eos_token_id"] = n - 3
    assert Tokenizer.from_metadata(meta).eog_ids == {n - 3}


# ---------- streaming decode ----------
@pytest.mark.parametrize("seed", range(5))
def test_incremental_decode_equals_full_decode(small, seed):
    rng = random.Random(seed)
    n = small.vocab_size
    for _ in range(30):
        # Mix of random ids (byte tokens split UTF-8 arbitrarily) and encodings of real text.
        ids = [rng.randrange(n) for _ in range(rng.randint(0, 20))]
        ids += small.encode(random_text(rng, 5))
        ids += [rng.randrange(128, 256) for _ in range(rng.randint(0, 4))]
        rng.shuffle(ids)
        dec = IncrementalDecoder(small)
        streamed = "".join(dec.push(i) for i in ids) + dec.flush()
        assert streamed == small.decode(ids)


def test_incremental_decoder_holds_back_partial_utf8(small):
    emoji = "🙂".encode()  # 4 bytes -> 4 byte tokens
    ids = [small.token_id(BYTE_TO_CHAR[b]) for b in emoji]
    assert ids == list(emoji)  # byte tokens sit at ids 0..255 in byte order
    dec = IncrementalDecoder(small)
    assert [dec.push(i) for i in ids] == ["", "", "", "🙂"]
    assert dec.push(small.token_id(BYTE_TO_CHAR[0xE4])) == ""
    assert dec.flush() == "\ufffd"  # a dangling lead byte is replaced at the end


# ---------- errors ----------
@pytest.mark.parametrize(
    "change, message",
    [
        ({"tokenizer.ggml.model": "llama"}, "only 'gpt2'"),
        ({"tokenizer.ggml.pre": "qwen2"}, "unsupported tokenizer.ggml.pre 'qwen2'"),
        ({"tokenizer.ggml.merges": ["a"]}, r"merges\[0\]"),
        ({"tokenizer.ggml.bos_token_id": 10**7}, "bos_token_id"),
        ({"tokenizer.ggml.token_type": [1, 1]}, "token_type has 2 entries"),
    ],
)
def test_bad_metadata_raises_clear_error(small_meta, change, message):
    with pytest.raises(ValueError, match=message):
        Tokenizer.from_metadata(dict(small_meta, **change))


def test_missing_key_and_bad_ids(small_meta, small):
    meta = {k: v for k, v in small_meta.items() if k != "tokenizer.ggml.tokens"}
    with pytest.raises(ValueError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_metadata(meta)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        small.decode([small.vocab_size])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        small.token_text(-1)
    with pytest.raises(ValueError, match="must be an integer"):
        small.decode([1.5])
    with pytest.raises(TypeError):
        small.encode(b"bytes")  # type: ignore[arg-type]
    import numpy as np

    ids = small.encode("numpy ids")
    assert small.decode(np.array(ids, dtype=np.int64)) == "numpy ids"


# ---------- synthetic vocabularies ----------
def _check_valid_bpe(meta: dict) -> None:
    tokens = meta["tokenizer.ggml.tokens"]
    known = set(tokens)
    assert len(known) == len(tokens)
    for m in meta["tokenizer.ggml.merges"]:
        a, b = m.split(" ")
        assert a in known and b in known and a + b in known, m
    assert len(meta["tokenizer.ggml.token_type"]) == len(tokens)


def test_synthetic_vocab_is_valid_bpe(small_meta, big_meta):
    for meta in (small_meta, big_meta):
        _check_valid_bpe(meta)
        assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "gpt-4o"
        assert meta["tokenizer.ggml.tokens"][:256] == [BYTE_TO_CHAR[b] for b in range(256)]
        assert "<|start|>" in meta["tokenizer.chat_template"]


def test_synthetic_small_vocab_specials_at_end(small_meta, small):
    n = small.vocab_size
    assert n == 3000
    assert small.token_id("<|startoftext|>") == n - 16
    assert small.token_id("<|call|>") == n - 16 + (200012 - 199998)
    assert small.token_id("<|reserved_200013|>") == n - 1
    types = small_meta["tokenizer.ggml.token_type"]
    assert types[: n - 16] == [1] * (n - 16) and types[n - 16 :] == [TOKEN_CONTROL] * 16


def test_synthetic_is_seeded(small_meta):
    assert make_vocab(3000, seed=1, preset="tiny") == small_meta
    assert make_vocab(3000, seed=2, preset="tiny")["tokenizer.ggml.merges"] != small_meta["tokenizer.ggml.merges"]


@pytest.mark.parametrize(
    "args, message",
    [((200, 0, "tiny"), "too small"), ((4096, 0, "120b"), "needs n_vocab=201088"), ((4096, 0, "huge"), "unknown preset")],
)
def test_synthetic_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        make_vocab(*args)


def test_token_bytes_fast_and_slow_paths_and_bad_token(small_meta):
    """Token bytes come from one array lookup when every token is byte-level; a special token
    outside the alphabet takes the per-token path (stored raw, UTF-8); a normal one is an error."""
    fast = Tokenizer.from_metadata(small_meta)
    ids = range(len(small_meta["tokenizer.ggml.tokens"]))
    types = small_meta["tokenizer.ggml.token_type"]
    for i in ids:
        text = small_meta["tokenizer.ggml.tokens"][i]
        special = types[i] in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
        assert fast.token_bytes(i) == (text.encode("utf-8") if special else byte_level_decode(text))
    meta = dict(small_meta)
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta["tokenizer.ggml.token_type"])
    tokens.append("<|\u4e2d|>")
    types.append(TOKEN_CONTROL)
    slow = Tokenizer.from_metadata({**meta, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types})
    assert slow.token_bytes(len(tokens) - 1) == "<|\u4e2d|>".encode("utf-8")
    assert all(slow.token_bytes(i) == fast.token_bytes(i) for i in ids)
    types[-1] = 1  # NORMAL: must be byte-level
    with pytest.raises(ValueError, match=rf"tokens\[{len(tokens) - 1}\].*byte-level"):
        Tokenizer.from_metadata({**meta, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types})
