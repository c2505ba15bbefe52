"""Train the demo model's byte-level BPE (about 4k entries) on demo/work/corpus/train.jsonl.

The pre-tokenizer is the one the engine uses for GGUF `tokenizer.ggml.pre = "gpt-4o"`: a Split on the
o200k regex, then ByteLevel without its own regex. The harmony formatting tokens are specials (ids 0..8).
Output: demo/work/tokenizer.json.  Run: python demo/tokenizer.py  (a few seconds)
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

WORK = Path(__file__).resolve().parent / "work"
VOCAB_SIZE = 4096
SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
            "<|start|>", "<|end|>", "<|message|>", "<|call|>"]
# The engine's own gpt-4o split, so the trained BPE cannot drift from what GGUF loading uses.
from hybridmoe.tokenizer.tokenizer import O200K_PATTERN  # noqa: E402

_SPECIAL_RE = re.compile("|".join(re.escape(s) for s in SPECIALS))


def new_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def training_texts(path: Path):
    with open(path) as f:
        for line in f:
            # markup is learned as special tokens; keep it out of the merges
            yield _SPECIAL_RE.sub("\n", json.loads(line)["text"])


def train(corpus: Path, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=[AddedToken(s, special=True, normalized=False) for s in SPECIALS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_texts(corpus), trainer=trainer)
    return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = ap.parse_args()
    tok = train(WORK / "corpus" / "train.jsonl", args.vocab_size)
    tok.save(str(WORK / "tokenizer.json"))
    sample = "<|start|>user<|message|>Hello there!<|end|><|start|>assistant"
    print("vocab", tok.get_vocab_size(), "| specials", [tok.token_to_id(s) for s in SPECIALS])
    print(sample, "->", tok.encode(sample).tokens)


if __name__ == "__main__":
    main()
