"""Where a decode step's time goes, part by part, in the exact and the `--fast-math` mode.

    python bench/decode_breakdown.py -m FILE.gguf [-t 2] [--modes exact fast] [--steps 32] [--ctx 512]
                                     [--streams 1] [--runs 3] [--json out.json]

Each mode runs in its own child process (its own memory, OMP settings as the CLI sets them),
modes alternating over `--runs`. A child loads the model, prefills `--ctx` tokens, then times
`--steps` one-token forwards with a timer around each part of every layer:

  q/k/v GEMV, attention (rope, KV write, attention over the cache), attn_output GEMV, attention
  block rest (norm, residual), router + norm + residual (the MoE block minus the experts), MoE
  experts, output head GEMV, and the rest (embedding, final norm, Python, step bookkeeping).

Per part: ms per token (median over steps, then over runs), share of the step, the bytes it reads
per token (weights as the model holds them: Q4_0/Q5_0/IQ4_NL transcoded to Q8_0; the routed share
k/E of the expert tensors; the KV cache for attention) and GB/s against the read bandwidth that
the same child measured right after its steps. A timer costs ~0.2 us; the step time is measured
with the timers on.

On the CPU the MoE block is one kernel call (norm, router, experts, residual add): there "MoE
experts" is that call and "router + norm + residual" what Python spends around it.

`--streams N` times steps of N sequences at once (each with its own cache and prompt), as a server
with N busy slots runs them: times and bytes are per step, the experts' bytes those of the distinct
experts the step's tokens were routed to, tok/s = N / step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

import machine
import record

PARTS = ("q/k/v GEMV", "attention", "attn_output GEMV", "attention block rest", "router + norm + residual",
         "MoE experts", "output head", "embedding, Python, rest")
MODES = ("exact", "fast")


class Timed:
    """Stands in for a callable part of the model, adding the seconds of each call to `spent[part]`
    and passing every other attribute through."""

    def __init__(self, inner, part: str, spent: dict[str, float]):
        self._inner, self._part, self._spent = inner, part, spent

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self._inner(*args, **kwargs)
        finally:
            self._spent[self._part] += time.perf_counter() - t

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


class CountedExperts(Timed):
    """The experts call, also adding up the distinct experts each call's tokens were routed to."""

    def __init__(self, inner, spent: dict[str, float]):
        super().__init__(inner, "MoE experts", spent)

    def __call__(self, h, ids, weights):
        self._spent["distinct experts"] += len(set(ids.reshape(-1).tolist()))
        return super().__call__(h, ids, weights)

    def block(self, x, norm_w, eps, router_w, router_b, k):
        """The fused MoE block (norm, router, experts, residual in one kernel call), timed whole."""
        import torch

        ids, wts = torch.empty((x.shape[0], k), dtype=torch.int32), torch.empty((x.shape[0], k))
        t = time.perf_counter()
        try:
            return self._inner.block(x, norm_w, eps, router_w, router_b, k, routing_out=(ids, wts))
        finally:
            self._spent[self._part] += time.perf_counter() - t
            self._spent["distinct experts"] += len(set(ids.reshape(-1).tolist()))


def held_bytes(mf, name: str) -> int:
    """Bytes of a tensor as the CPU model holds it (the exactly-Q8_0 block types become Q8_0)."""
    from hybridmoe.gguf.constants import BLOCK_SIZES, GGMLType
    from hybridmoe.quant.formats import Q8_0_EXACT_TYPES

    info = mf.tensors[name]
    if info.ggml_type in Q8_0_EXACT_TYPES:
        block, size = BLOCK_SIZES[GGMLType.Q8_0]
        return int(np.prod(info.ne)) // block * size
    return info.nbytes


def bytes_per_step(llm, cached: int, streams: int, distinct_per_layer: float) -> dict[str, float]:
    """What each part reads in one decode step of `streams` sequences after `cached` tokens each, the
    step's tokens routed to `distinct_per_layer` experts on average."""
    from hybridmoe.models.gpt_oss import tensor_names

    cfg, mf = llm.config, llm.file
    out = dict.fromkeys(PARTS, 0.0)
    kv_elem = llm.model.kv_dtype.itemsize
    for i in range(cfg.n_layers):
        names = tensor_names(cfg, i)
        size = lambda key: held_bytes(mf, names[key]) if names[key] in mf.tensors else 0  # noqa: E731
        out["q/k/v GEMV"] += sum(size(p) + size(p + "_bias") for p in ("q", "k", "v"))
        out["attn_output GEMV"] += size("o") + size("o_bias")
        span = min(cached, cfg.sliding_window) if cfg.layer_is_sliding(i) else cached
        out["attention"] += 2 * cfg.n_kv_heads * cfg.head_dim * span * kv_elem * streams
        out["router + norm + residual"] += size("router") + size("router_bias")
        experts = sum(size(k) for k in ("gate_exps", "up_exps", "gate_up_exps", "down_exps", "gate_exps_bias",
                                        "up_exps_bias", "gate_up_exps_bias", "down_exps_bias"))
        out["MoE experts"] += experts * distinct_per_layer / cfg.n_experts
    out["output head"] = held_bytes(mf, "output.weight")
    return out


def instrument(model) -> dict[str, float]:
    """Wraps every timed part of `model` in place; returns the seconds accumulator."""
    spent = dict.fromkeys(PARTS + ("attention block", "MoE block", "distinct experts"), 0.0)
    for layer in model.layers:
        attn, moe = layer.attention, layer.moe
        attn.qkv = Timed(attn.qkv, "q/k/v GEMV", spent)
        attn.attend = Timed(attn.attend, "attention", spent)
        attn.o = Timed(attn.o, "attn_output GEMV", spent)
        moe.experts = CountedExperts(moe.experts, spent)
        layer.attention = Timed(attn, "attention block", spent)
        layer.moe = Timed(moe, "MoE block", spent)
    model.output = Timed(model.output, "output head", spent)
    return spent


def exclusive(spent: dict[str, float], step_s: float) -> dict[str, float]:
    """Each part's own seconds: the blocks less the parts timed inside them, the step less all."""
    own = {p: spent[p] for p in PARTS[:-1]}
    own["attention block rest"] = spent["attention block"] - spent["q/k/v GEMV"] - spent["attention"] \
        - spent["attn_output GEMV"]
    own["router + norm + residual"] = spent["MoE block"] - spent["MoE experts"]
    own["embedding, Python, rest"] = step_s - spent["attention block"] - spent["MoE block"] - spent["output head"]
    return own


def child(model_path: str, threads: int, mode: str, steps: int, ctx: int, streams: int) -> dict:
    from hybridmoe import LLM, ComputeSettings, ContextSettings
    from hybridmoe.models.gpt_oss import SeqChunk

    llm = LLM(model_path, compute=ComputeSettings(threads=threads, fast_math=mode == "fast"),
              context=ContextSettings(ctx_size=ctx + steps + 8))
    caches = [llm.model.make_cache(ctx + steps + 8) for _ in range(streams)]
    for s, cache in enumerate(caches):  # each stream its own prompt, so their tokens route apart
        llm.prefill(cache, [(i * 7919 + s * 104729) % 1000 + 10 for i in range(ctx)])
    spent = instrument(llm.model)
    per_step: list[dict[str, float]] = []
    distinct: list[float] = []
    for i in range(steps + 1):  # the first step warms the timers' paths and is dropped
        for k in spent:
            spent[k] = 0.0
        t = time.perf_counter()
        llm.model.forward([SeqChunk(cache, [100 + i + 37 * s]) for s, cache in enumerate(caches)])
        step_s = time.perf_counter() - t
        if i:
            per_step.append({**exclusive(spent, step_s), "step": step_s})
            distinct.append(spent["distinct experts"] / llm.config.n_layers)
    bw, how = machine.read_bandwidth(threads)
    per_layer = statistics.mean(distinct)
    return {"mode": mode, "streams": streams, "parts_s": {k: statistics.median(s[k] for s in per_step)
                                                          for k in (*PARTS, "step")},
            "distinct_experts_per_layer": per_layer, "bytes": bytes_per_step(llm, ctx, streams, per_layer),
            "read_bw_gbs": bw, "read_bw_how": how}


def run_child(args: argparse.Namespace, mode: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), OMP_WAIT_POLICY="PASSIVE")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "-m", args.model, "-t", str(args.threads),
           "--steps", str(args.steps), "--ctx", str(args.ctx), "--streams", str(args.streams)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise SystemExit(f"{mode} child failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(lines[-1])


def rows_for(results: list[dict], mode: str) -> list[dict]:
    """Table rows of one mode: medians over its runs."""
    runs = [r for r in results if r["mode"] == mode]
    med = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
    step = med(lambda r: r["parts_s"]["step"])
    bw = med(lambda r: r["read_bw_gbs"])
    rows = []
    for part in (*PARTS, "step"):
        secs = med(lambda r: r["parts_s"][part])
        nbytes = sum(runs[0]["bytes"].values()) if part == "step" else runs[0]["bytes"].get(part, 0.0)
        gbs = nbytes / secs / 1e9 if nbytes and secs > 0 else None
        rows.append({"mode": mode, "part": part, "ms/step": secs * 1e3, "share of step": secs / step,
                     "MB/step": nbytes / 1e6 if nbytes else None, "GB/s": gbs,
                     "share of read bw": gbs / bw if gbs else None})
    rows.append({"mode": mode, "part": "tok/s", "ms/step": runs[0]["streams"] / step})
    rows.append({"mode": mode, "part": "experts read per layer", "ms/step": med(lambda r: r["distinct_experts_per_layer"])})
    rows.append({"mode": mode, "part": "read bandwidth (GB/s)", "ms/step": bw})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=512, help="tokens cached before the timed steps")
    ap.add_argument("--streams", type=int, default=1, help="sequences decoded together in each step")
    ap.add_argument("--runs", type=int, default=3, help="child runs per mode, modes alternating")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    record.add_json_arg(ap)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.threads, args.child, args.steps, args.ctx, args.streams)), flush=True)
        return

    print(machine.describe())
    rec = record.new("decode_breakdown", {"model": os.path.basename(args.model), "threads": args.threads,
                                          "steps": args.steps, "cached": args.ctx, "streams": args.streams, "runs": args.runs,
                                          "modes": args.modes})
    results = []
    for run in range(args.runs):
        for mode in args.modes if run % 2 == 0 else args.modes[::-1]:
            r = run_child(args, mode)
            results.append(r)
            rec["runs"].append({"run": run, **r})
            print(f"run {run} {mode}: {1 / r['parts_s']['step']:.2f} tok/s, read bandwidth "
                  f"{r['read_bw_gbs']:.1f} GB/s ({r['read_bw_how']})", flush=True)
    rows = [row for mode in args.modes for row in rows_for(results, mode)]
    print(f"\nmodel {args.model}  threads {args.threads}  cached {args.ctx}  streams {args.streams}  "
          f"steps {args.steps}  runs {args.runs}")
    print(f"{'mode':6} {'part':28} {'ms/step':>9} {'share':>6} {'MB/step':>9} {'GB/s':>7} {'of bw':>6}")
    for row in rows:
        cells = [f"{row['mode']:6} {row['part']:28} {row['ms/step']:9.2f}"]
        if "share of step" in row:
            mb, gbs, of = row["MB/step"], row["GB/s"], row["share of read bw"]
            cells.append(f"{row['share of step']:6.0%} " + (f"{mb:9.1f}" if mb else f"{'-':>9}")
                         + (f" {gbs:7.1f} {of:6.0%}" if gbs else f" {'-':>7} {'-':>6}"))
        print(" ".join(cells))
    rec["rows"] = rows
    record.write(rec, args.json)


if __name__ == "__main__":
    main()
