"""Decode speed with self-speculative decoding (`--spec-type ngram-simple`) against plain decoding.

    python bench/speculative.py [-m 20b.gguf] [-t 2] [--tokens 96] [--repeats 3] [--fast-math] [--json out.json]

A synthetic model never repeats itself, so the n-gram lookup finds nothing to draft on it. The
rows "drafts right p of the time" therefore replace the lookup with an oracle that proposes the
plain run's next tokens, each spoiled with probability 1 - p (`size_m` tokens a proposal): what
the engine does with drafts of that quality on this model and machine, the draft lengths cut by
its measured step costs as always. The row "real lookup" uses the n-gram lookup itself (on the
synthetic model: its cost when nothing matches). `--demo` adds the bundled demo model writing
repeated code, real lookup. Greedy; decode tok/s from the engine's own timings (first token
excluded); medians of --repeats runs, plain and speculative alternating. "same" counts the
leading tokens equal to plain decoding's (worst run): the batched forward rounds differently from
one-token steps, which can decide a near-tie the other way (rarely in the exact mode, more often
with --fast-math's int8 activations); after that the oracle's drafts stop matching.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
from pathlib import Path

import machine
import record

DEFAULT_MODEL = "/work/bench-data/gpt-oss-20b-synth.gguf"
DEMO = Path(__file__).resolve().parents[1] / "src" / "hybridmoe" / "data" / "demo.gguf"
DEMO_PROMPT = "def add(a, b):\n    return a + b\n\n" * 3


class OracleLookup:
    """The plain reply's next tokens, each spoiled with probability 1 - p."""

    def __init__(self, n_prompt: int, reply: list[int], p: float, vocab: int, seed: int) -> None:
        self.n_prompt, self.reply, self.p, self.vocab = n_prompt, reply, p, vocab
        self.rng = random.Random(seed)

    def __call__(self, history, size_n, size_m, min_hits=1):
        import numpy as np

        g = len(history) - self.n_prompt
        draft = [t if self.rng.random() < self.p else (t + 1) % self.vocab for t in self.reply[g : g + size_m]]
        return np.array(draft, dtype=np.int32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=DEFAULT_MODEL)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--accept", type=float, nargs="*", default=[1.0, 0.9, 0.6, 0.0])
    ap.add_argument("--fast-math", action="store_true")
    ap.add_argument("--demo", action="store_true", help="add the demo model's repeated-code row")
    record.add_json_arg(ap)
    args = ap.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    print(machine.describe())
    rec = record.new("speculative", {"model": os.path.basename(args.model), "threads": args.threads,
                                     "tokens": args.tokens, "repeats": args.repeats, "fast_math": args.fast_math})

    from hybridmoe import LLM, ComputeSettings
    from hybridmoe.engine import speculative
    from hybridmoe.settings import SpeculativeSettings

    compute = ComputeSettings(threads=args.threads, fast_math=args.fast_math)
    plain = LLM(args.model, compute=compute)
    spec = LLM(args.model, compute=compute, speculative=SpeculativeSettings(ngram=True))
    prompt = [(1000 + 7919 * i) % plain.config.vocab_size for i in range(64)]
    kw = dict(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    # Every timed run finds the prompt cached (its last token computed alone): the reference and
    # both engines are warmed first, so no run differs from another by how its prompt was batched.
    plain.generate(prompt, max_tokens=1, temperature=0.0)
    spec.generate(prompt, max_tokens=1, temperature=0.0)
    reply = plain.generate(prompt, **kw).token_ids
    real_lookup = speculative.ngram_draft

    def case(name: str, llm_a, llm_b, ids, lookup) -> None:
        plain_runs, spec_runs, drafted, kept, same = [], [], [], [], []
        for i in range(args.repeats):
            a = llm_a.generate(ids, **kw)
            speculative.ngram_draft = lookup(i) if lookup else real_lookup
            try:
                b = llm_b.generate(ids, **kw)
            finally:
                speculative.ngram_draft = real_lookup
            if b.token_ids != a.token_ids:  # a near-tie decided differently by the batched forward's rounding
                same.append(next(i for i, (x, y) in enumerate(zip(a.token_ids + [-1], b.token_ids + [-2])) if x != y))
            else:
                same.append(len(a.token_ids))
            plain_runs.append(a.timings["predicted_per_second"])
            spec_runs.append(b.timings["predicted_per_second"])
            drafted.append(b.timings.get("draft_n", 0))
            kept.append(b.timings.get("draft_n_accepted", 0))
        p, s = statistics.median(plain_runs), statistics.median(spec_runs)
        row = {"case": name, "plain_tok_s": p, "spec_tok_s": s, "ratio": s / p,
               "drafted": statistics.median(drafted), "kept": statistics.median(kept),
               "same_tokens": min(same)}
        print(f"{name:<34} {p:9.2f} {s:9.2f} {s / p:7.2f}x {row['drafted']:8.0f} {row['kept']:6.0f} {min(same):6d}",
              flush=True)
        rec["rows"].append(row)
        rec["runs"] += [{"case": name, "repeat": i, "plain_tok_s": x, "spec_tok_s": y}
                        for i, (x, y) in enumerate(zip(plain_runs, spec_runs))]

    print(f"{'case':<34} {'plain':>9} {'spec':>9} {'ratio':>8} {'drafted':>8} {'kept':>6} {'same':>6}"
          "   (tok/s, medians; same: tokens equal to plain decoding's, worst run)")
    vocab = plain.config.vocab_size
    for p in args.accept:
        case(f"drafts right {p:.0%} of the time", plain, spec, prompt,
             lambda i, p=p: OracleLookup(len(prompt), reply, p, vocab, seed=i))
    case("real lookup (nothing repeats)", plain, spec, prompt, None)
    if args.demo and DEMO.exists():
        dplain = LLM(DEMO, compute=compute)
        dspec = LLM(DEMO, compute=compute, speculative=SpeculativeSettings(ngram=True))
        ids = dplain.tokenize(DEMO_PROMPT)
        dplain.generate(ids, max_tokens=1, temperature=0.0)
        dspec.generate(ids, max_tokens=1, temperature=0.0)
        case("demo model, repeated code", dplain, dspec, ids, None)
    record.write(rec, args.json)


if __name__ == "__main__":
    main()
