"""Cost of choosing one token: `Sampler.sample` (and `accept`) on a vocabulary-sized logit row.

    python bench/sampling.py [--vocab 201088] [--tokens 50] [--repeats 5] [-t 2] [--json out.json]

Logits are random (normal, x3: a flatter row than a trained model's, so top-p over the full
vocabulary finds its mass late); each case's figure is the median over --repeats runs of the mean
time per token over --tokens draws. Cases whose settings the installed version does not know are
left out, so the script also measures an older checkout (PYTHONPATH=that/src).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import machine
import record

# name -> (SamplingParams fields, SamplerSettings fields)
CASES = {
    "default (T 0.8, top-k 40, top-p 0.95, min-p 0.05)": ({"temperature": 0.8}, {}),
    "T 1, no filters (OpenAI's advice for gpt-oss)": ({"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}, {}),
    "greedy": ({"temperature": 0.0}, {}),
    "default + repeat_penalty 1.1": ({"temperature": 0.8}, {"repeat_penalty": 1.1}),
    "default + DRY 0.8 (whole context)": ({"temperature": 0.8}, {"dry_multiplier": 0.8}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=201088)
    ap.add_argument("--tokens", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int, default=2, help="torch threads")
    record.add_json_arg(ap)
    args = ap.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    print(machine.describe())
    rec = record.new("sampling", {"vocab": args.vocab, "tokens": args.tokens, "repeats": args.repeats,
                                  "threads": args.threads})

    import torch

    from hybridmoe.engine import sampler

    torch.set_num_threads(args.threads)
    logits = torch.randn(args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    history = [(i * 7919) % args.vocab for i in range(2000)]
    print(f"{'case':<52} {'ms/token':>9} {'runs':>24}")
    for name, (fields, chain) in CASES.items():
        try:
            params = sampler.SamplingParams(seed=1, **fields)
            if chain:
                from hybridmoe.settings import SamplerSettings

                params = sampler.SamplingParams(seed=1, **fields, chain=SamplerSettings(**chain))
        except (TypeError, ImportError):
            continue  # a version without these settings
        runs = []
        for _ in range(args.repeats):
            s = sampler.Sampler(params, history=history) if chain else sampler.Sampler(params)
            for _ in range(3):
                s.sample(logits)
            t = time.perf_counter()
            for _ in range(args.tokens):
                tok = s.sample(logits)
                if hasattr(s, "accept"):
                    s.accept(tok)
            runs.append((time.perf_counter() - t) / args.tokens * 1e3)
        med = statistics.median(runs)
        print(f"{name:<52} {med:9.2f} {' '.join(f'{r:.2f}' for r in runs):>24}")
        rec["rows"].append({"case": name, "ms_per_token": med})
        rec["runs"] += [{"case": name, "repeat": i, "ms_per_token": r} for i, r in enumerate(runs)]
    record.write(rec, args.json)


if __name__ == "__main__":
    main()
