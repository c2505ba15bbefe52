"""Synthetic byte-level BPE vocabularies for synthetic gpt-oss GGUF files.

Layout: ids 0..255 are the 256 single bytes (in byte order), then merge results in merge order
(merges trained on seeded English-ish text, then seeded filler merges up to the requested size),
then the harmony special tokens. For n_vocab == 201088 the specials sit at gpt-oss's exact ids
(199998..201087); for other sizes the same 16-token block 199998..200013 is placed at the end.
"""

from __future__ import annotations

import json
import random
from importlib import resources
from typing import Any

import numpy as np
from tokenizers import Regex, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as _HFTokenizer

from .tokenizer import BYTE_TO_CHAR, O200K_PATTERN, TOKEN_CONTROL, TOKEN_NORMAL

GPT_OSS_VOCAB = 201088
FIRST_SPECIAL_ID = 199998  # gpt-oss: ids below are o200k text tokens
# Named harmony specials by their gpt-oss id; every other id from 199998 up is <|reserved_ID|>.
HARMONY_SPECIALS = {
    199998: "<|startoftext|>",
    199999: "<|endoftext|>",
    200002: "<|return|>",
    200003: "<|constrain|>",
    200005: "<|channel|>",
    200006: "<|start|>",
    200007: "<|end|>",
    200008: "<|message|>",
    200012: "<|call|>",
}
SMALL_SPECIAL_BLOCK = 16  # ids 199998..200013: every named special plus the reserved ones between
PRESETS = ("tiny", "20b", "120b")
_MIN_MERGES = 64

# Our own list of common English words plus the words harmony prompts are made of, so that
# harmony headers and everyday text tokenize to few tokens.
_WORDS = """
the be to of and a in that have I it for not on with he as you do at this but his by from they we
say her she or an will my one all would there their what so up out if about who get which go me
when make can like time no just him know take people into year your good some could them see other
than then now look only come its over think also back after use two how our work first well way
even new want because any these give day most us is are was were been has had did said made went
hello world answer question help please thank thanks yes sure great problem simple number numbers
weather today tomorrow city temperature location celsius fahrenheit sunny rain cloudy wind
user assistant system developer tool tools function functions analysis final commentary channel
message json type string boolean object array null true false name description parameters
properties required default enum namespace any reasoning knowledge cutoff current date valid
must included every calls these instructions response format model language large trained
chatgpt openai low medium high quick brown fox jumps lazy dog compute sum add multiply python
code file data read write open close list value key result error test check run start end stop
water fire earth air light dark red blue green white black small big long short old young life
house home school book story word words line page name names place places thing things man woman
child children hand hands eye eyes head face door room car road tree trees river sea sky sun moon
""".split()


_HEADER_WORDS = ["assistant", "analysis", "final", "commentary", "user", "system", "developer", "json"]


def make_vocab(n_vocab: int, seed: int = 0, preset: str = "tiny") -> dict[str, Any]:
    """GGUF tokenizer metadata (`tokenizer.ggml.*` + `tokenizer.chat_template`) for a synthetic model.

    `preset` is the synth preset name; "20b"/"120b" require gpt-oss's vocabulary size 201088.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {PRESETS}")
    if preset != "tiny" and n_vocab != GPT_OSS_VOCAB:
        raise ValueError(f"preset {preset!r} needs n_vocab={GPT_OSS_VOCAB} (gpt-oss), got {n_vocab}")
    min_vocab = 256 + SMALL_SPECIAL_BLOCK + _MIN_MERGES
    if n_vocab < min_vocab:
        raise ValueError(f"n_vocab={n_vocab} is too small; need at least {min_vocab}")

    if n_vocab == GPT_OSS_VOCAB:
        special_start = FIRST_SPECIAL_ID
        specials = [_special_name(FIRST_SPECIAL_ID + k) for k in range(n_vocab - FIRST_SPECIAL_ID)]
    else:
        special_start = n_vocab - SMALL_SPECIAL_BLOCK
        specials = [_special_name(FIRST_SPECIAL_ID + k) for k in range(SMALL_SPECIAL_BLOCK)]
    n_merges = special_start - 256

    rng = random.Random(seed)
    byte_tokens = [BYTE_TO_CHAR[b] for b in range(256)]
    merges = _trained_merges(rng, n_merges)
    merges += _filler_merges(rng, byte_tokens, merges, n_merges - len(merges))
    tokens = byte_tokens + [a + b for a, b in merges] + specials
    assert len(tokens) == n_vocab and len(set(tokens)) == n_vocab

    def sid(name: str) -> int:
        return special_start + specials.index(name)

    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-4o",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [TOKEN_NORMAL] * special_start + [TOKEN_CONTROL] * len(specials),
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges],
        "tokenizer.ggml.bos_token_id": sid("<|startoftext|>"),
        "tokenizer.ggml.eos_token_id": sid("<|return|>"),
        "tokenizer.ggml.padding_token_id": sid("<|endoftext|>"),
        "tokenizer.chat_template": harmony_template(),
    }


def harmony_template() -> str:
    """Our harmony chat template (package data `data/harmony_template.jinja`)."""
    return resources.files("hybridmoe").joinpath("data/harmony_template.jinja").read_text(encoding="utf-8")


def _special_name(gpt_oss_id: int) -> str:
    return HARMONY_SPECIALS.get(gpt_oss_id, f"<|reserved_{gpt_oss_id}|>")


def _corpus(rng: random.Random, num_sentences: int = 3000) -> list[str]:
    """Seeded sentences over the word list, Zipf-weighted so that common words merge first."""
    words = list(_WORDS)
    rng.shuffle(words)
    weights = [1.0 / (k + 1) ** 0.8 for k in range(len(words))]
    lines = []
    for _ in range(num_sentences):
        picked = rng.choices(words, weights, k=rng.randint(4, 12))
        if rng.random() < 0.5:
            picked[0] = picked[0].capitalize()
        line = " ".join(picked) + rng.choice([".", ".", ",", "?", "!", ":"])
        if rng.random() < 0.2:
            line += f" {rng.randint(0, 999)}"
        lines.append(line)
    # Header words stand alone between harmony specials (`<|channel|>final<|message|>`), so teach
    # their no-leading-space forms too.
    lines += [w for w in _HEADER_WORDS for _ in range(40)]
    return lines


def _trained_merges(rng: random.Random, max_merges: int) -> list[tuple[str, str]]:
    """Merges learned by byte-level BPE training on the seeded corpus (at most max_merges)."""
    tk = _HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    alphabet = [BYTE_TO_CHAR[b] for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=256 + max_merges, min_frequency=2, show_progress=False, initial_alphabet=alphabet
    )
    tk.train_from_iterator(_corpus(rng), trainer)
    raw = json.loads(tk.to_str())["model"]["merges"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in raw]
    return [(a, b) for a, b in merges][:max_merges]


def _filler_merges(
    rng: random.Random, byte_tokens: list[str], merges: list[tuple[str, str]], count: int
) -> list[tuple[str, str]]:
    """`count` further valid merges: concatenations of two existing tokens, ranked after the trained
    ones so they never change how the corpus words tokenize."""
    # Pool of existing tokens, letters and short pieces first so fillers look like word pieces;
    # sampling the pool with an exponential index bias keeps most new tokens short.
    letters = [BYTE_TO_CHAR[b] for b in range(256) if chr(b).isalpha() and b < 128]
    pool = letters + [BYTE_TO_CHAR[ord(" ")]] + [a + b for a, b in merges]
    known = set(byte_tokens) | {a + b for a, b in merges}
    out: list[tuple[str, str]] = []
    # Random draws come from numpy in batches (Python's random is the bottleneck at 200k merges).
    np_rng = np.random.default_rng(rng.getrandbits(64))
    while len(out) < count:
        batch = 2 * (count - len(out)) + 64
        first = np.minimum(np_rng.exponential(400.0, batch).astype(np.int64), len(pool) - 1).tolist()
        take_letter = (np_rng.random(batch) < 0.7).tolist()
        letter_idx = np_rng.integers(0, len(letters), batch).tolist()
        pool_idx = np_rng.integers(0, len(pool), batch).tolist()
        for k in range(batch):
            a = pool[first[k]]
            b = letters[letter_idx[k]] if take_letter[k] else pool[pool_idx[k]]
            new = a + b
            if new in known or len(new) > 24:
                continue
            known.add(new)
            pool.append(new)
            out.append((a, b))
            if len(out) == count:
                break
    return out
