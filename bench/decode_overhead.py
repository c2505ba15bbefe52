"""Python overhead of a decode step: step time vs time spent inside the C kernels.

    python bench/decode_overhead.py -m /path/to/gpt-oss-20b-synth.gguf -t 2 [--steps 16] [--ctx 512] [--json out.json]

Prints a table per step count: median step ms, median kernel ms (MoE, Q8_0 linears incl. the
fused q/k/v group, decode attention; timed around each call, Python wrapper included) and the rest (torch ops + Python), with the overhead share. Write a 20b file
with `hybridmoe synth --preset 20b --out FILE`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import machine
import record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=512, help="tokens already cached before timing")
    record.add_json_arg(ap)
    args = ap.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads, as the CLI does
    print(machine.describe())
    rec = record.new("decode_overhead", {"model": os.path.basename(args.model), "threads": args.threads,
                                         "steps": args.steps, "cached": args.ctx})

    from hybridmoe import LLM, ComputeSettings, ContextSettings, kernels
    from hybridmoe.models import weights
    from hybridmoe.models.gpt_oss import SeqChunk

    llm = LLM(args.model, compute=ComputeSettings(threads=args.threads),
              context=ContextSettings(ctx_size=args.ctx + args.steps + 8))
    spent = [0.0]

    def timed(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t

        return wrapper

    # Patch the names the model modules call through (before the model builds its q/k/v groups).
    kernels.moe_forward = timed(kernels.moe_forward)
    kernels.linear_q8_0 = timed(kernels.linear_q8_0)
    kernels.attn_decode = timed(kernels.attn_decode)
    kernels.LinearGroup.__call__ = timed(kernels.LinearGroup.__call__)
    weights.kernels = kernels

    cache = llm.model.make_cache(args.ctx + args.steps + 8)
    llm.prefill(cache, [(i * 7919) % 1000 + 10 for i in range(args.ctx)])
    steps, kern = [], []
    for i in range(args.steps):
        spent[0] = 0.0
        t = time.perf_counter()
        llm.model.forward([SeqChunk(cache, [100 + i])])
        steps.append(time.perf_counter() - t)
        kern.append(spent[0])
    s, k = statistics.median(steps) * 1e3, statistics.median(kern) * 1e3
    print(f"model {args.model}  threads {args.threads}  cached {args.ctx}  kernels isa {kernels.isa()}")
    print(f"{'step ms':>10} {'kernel ms':>10} {'other ms':>10} {'overhead':>9} {'tok/s':>7}")
    print(f"{s:10.1f} {k:10.1f} {s - k:10.1f} {100 * (s - k) / s:8.1f}% {1e3 / s:7.2f}")
    rec["params"]["isa"] = kernels.isa()
    rec["rows"] = [{"step_ms": s, "kernel_ms": k, "other_ms": s - k, "overhead share": (s - k) / s, "tok_s": 1e3 / s}]
    rec["runs"] = [{"step": i, "step_ms": a * 1e3, "kernel_ms": b * 1e3} for i, (a, b) in enumerate(zip(steps, kern))]
    record.write(rec, args.json)


if __name__ == "__main__":
    main()
