"""Where a decode step's time goes under a placement: torch.profiler over one-token decode steps.

    python bench/gpu_profile.py -m FILE [--placement cpu-moe|all-gpu|cpu] [-t N] [--steps 16]
                                [--ctx 512] [--top 20] [--json out.json]

Loads the model with the placement, fills `--ctx` tokens, times `--steps` greedy decode steps,
then profiles as many more (CPU and, with CUDA, GPU activity) and prints the ops with the most
self time and the kernel launches per step. For the next round of GPU work: which part of a
step is launches, host syncs, GPU kernels or the CPU experts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import machine
import record

PLACEMENTS = {"cpu-moe": {"cpu_moe": True}, "all-gpu": {"n_gpu_layers": 999}, "cpu": {"gpu_device": "cpu"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--placement", choices=sorted(PLACEMENTS), default="cpu-moe")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=512, help="tokens cached before the decode steps")
    ap.add_argument("--top", type=int, default=20, help="ops listed")
    ap.add_argument("--fast-math", action="store_true")
    record.add_json_arg(ap)
    args = ap.parse_args()
    print(machine.describe())

    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hybridmoe import LLM, ComputeSettings, ContextSettings, PlacementSettings
    from hybridmoe.models.gpt_oss import SeqChunk

    cuda = torch.cuda.is_available()
    rec = record.new("gpu_profile", {"model": os.path.basename(args.model), "placement": args.placement,
                                     "threads": args.threads, "steps": args.steps, "cached": args.ctx,
                                     "fast_math": args.fast_math})
    if cuda:
        rec["machine"]["gpu"] = torch.cuda.get_device_name(0)
    llm = LLM(args.model, compute=ComputeSettings(threads=args.threads, fast_math=args.fast_math),
              context=ContextSettings(ctx_size=args.ctx + 3 * args.steps + 8),
              placement=PlacementSettings(**PLACEMENTS[args.placement]))
    model = llm.model
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, size=args.ctx).tolist()
    cache = model.make_cache(args.ctx + 3 * args.steps + 4)
    logits = llm.prefill(cache, ids)

    def step() -> None:
        nonlocal logits
        tok = int(torch.argmax(logits).item())  # the host sync a real decode loop has too
        logits = model.forward([SeqChunk(cache, [tok])])[0]

    step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step_ms = statistics.median(times) * 1e3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    syncs = sum(e.count for e in events if "Synchronize" in e.key or e.key == "cudaStreamWaitEvent")
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    torch_cpu_ms = sum(e.self_cpu_time_total for e in events) / 1e3 / args.steps
    device_ms = sum(getattr(e, "self_device_time_total", 0.0) for e in events) / 1e3 / args.steps
    print(f"\n{args.placement}: decode step {step_ms:.1f} ms median ({1e3 / step_ms:.1f} tok/s) over {args.steps} "
          f"steps after {args.ctx} cached tokens; per step {launches / args.steps:.0f} kernel launches, "
          f"{syncs / args.steps:.0f} syncs/event waits; torch ops' self CPU time {torch_cpu_ms:.1f} ms, GPU kernels "
          f"{device_ms:.1f} ms (the rest of a step: C kernels and Python)")
    print(f"\ntop ops by {sort.replace('_', ' ')} ({args.steps} steps):")
    print(events.table(sort_by=sort, row_limit=args.top, max_name_column_width=48))
    if cuda:
        print("top ops by self CPU time:")
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=48))
    rec["rows"] = [{"placement": args.placement, "step_ms": step_ms, "tok_s": 1e3 / step_ms,
                    "launches_per_step": launches / args.steps, "syncs_per_step": syncs / args.steps,
                    "torch_cpu_ms_per_step": torch_cpu_ms, "gpu_ms_per_step": device_ms}]
    rec["top_ops"] = [{"op": e.key, "count": e.count, "self_cpu_us": e.self_cpu_time_total,
                       "self_device_us": getattr(e, "self_device_time_total", 0.0)}
                      for e in sorted(events, key=lambda e: -getattr(e, "self_device_time_total", 0.0)
                                      if cuda else -e.self_cpu_time_total)[: args.top]]
    record.write(rec, args.json)


if __name__ == "__main__":
    main()
