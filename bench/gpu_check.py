"""GPU check for the hybrid path: GPU logits vs CPU logits, then pp512 / tg128 tokens/s and peak
VRAM for --cpu-moe, --n-cpu-moe 12 and all-on-GPU, each next to what `hybridmoe plan` predicted.

Run through bench/gpu_check.sh (it builds the kernels first). Without CUDA the GPU rows are
skipped with a message; the plan predictions for the 20b shape are still printed (from a sparse
header) and the measuring code is smoke-tested on the tiny preset with every device `cpu`.

    python bench/gpu_check.py [--preset 20b] [--out bench/out] [--threads N] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

import machine
import record
from hybridmoe.gguf.reader import open_model
from hybridmoe.models.gpt_oss import GptOssConfig
from hybridmoe.placement import PlacementOptions, make_plan
from hybridmoe.settings import PlacementSettings
from hybridmoe.synth import write_synthetic

GIB = 1 << 30
CONFIGS = [  # (label, LLM placement options); n_gpu_layers=999 = everything on the GPU
    ("--cpu-moe", {"cpu_moe": True}),
    ("--n-cpu-moe 12", {"n_cpu_moe": 12}),
    ("all on GPU", {"n_gpu_layers": 999}),
]
PP, TG = 512, 128
LOGIT_TOKENS = 32
# Pass if the GPU path is as close to the CPU path as bf16/TF32 matmuls allow on random weights.
MAX_REL_ERR, MIN_TOP1 = 2e-2, 0.9


@dataclass
class Row:
    label: str
    plan_gpu_gib: float  # dense GPU weights kept as stored (Q8_0)
    plan_gpu_f32_gib: float  # dense GPU weights converted to f32 at load
    pp_tok_s: float | None = None
    tg_tok_s: float | None = None
    peak_alloc_gib: float | None = None
    peak_reserved_gib: float | None = None
    load_s: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def model_file(out_dir: str, preset: str, sparse: bool) -> str:
    path = os.path.join(out_dir, f"synth-{preset}{'-sparse' if sparse else ''}.gguf")
    if not os.path.exists(path):
        t0 = time.perf_counter()
        tmp = path + ".tmp"
        write_synthetic(tmp, preset, seed=0, sparse=sparse)
        os.replace(tmp, path)
        log(f"wrote {path} in {time.perf_counter() - t0:.1f} s")
    return path


def planned_gpu_gib(path: str, options: dict, ctx: int, device: str, dense: str = "stored") -> float:
    mf = open_model(path)
    try:
        cfg = GptOssConfig.from_metadata(mf.metadata)
        plan = make_plan(cfg, mf.tensors, PlacementOptions(
            PlacementSettings(gpu_device=device, gpu_dense_dtype=dense, **options), ctx_size=ctx, batch_size=PP))
    finally:
        mf.close()
    if plan.gpu_device == "cpu":
        return 0.0
    return plan.devices[plan.gpu_device].total_bytes / GIB


def free_everything() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def compare_logits(ref: np.ndarray, got: np.ndarray) -> dict:
    rel = float(np.abs(ref - got).max() / max(np.abs(ref).max(), 1e-30))
    top1 = float((ref.argmax(-1) == got.argmax(-1)).mean())
    return {"max_rel_err": rel, "top1_agree": top1, "ok": rel <= MAX_REL_ERR and top1 >= MIN_TOP1}


def measure(path: str, label: str, options: dict, ctx: int, threads: int, device: str,
            prompt: list[int], ref_logits: np.ndarray) -> Row:
    from hybridmoe import LLM, ComputeSettings, ContextSettings, PlacementSettings

    row = Row(label, planned_gpu_gib(path, options, ctx, device),
              planned_gpu_gib(path, options, ctx, device, "f32"))
    cuda = device.startswith("cuda")
    if cuda:
        free_everything()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    llm = LLM(path, compute=ComputeSettings(threads=threads), context=ContextSettings(ctx, PP, PP),
              placement=PlacementSettings(gpu_device=device, **options))
    row.load_s = time.perf_counter() - t0
    try:
        row.extra["logits"] = compare_logits(ref_logits, llm.logits(prompt[:LOGIT_TOKENS]))
        llm.generate(prompt[:16], max_tokens=2, temperature=0, ignore_eos=True)  # warm-up
        row.pp_tok_s = time_prefill(llm, prompt[:PP], cuda)
        r = llm.generate(prompt[:8], max_tokens=TG, temperature=0, ignore_eos=True)
        row.tg_tok_s = r.timings["predicted_per_second"]
        if len(r.token_ids) != TG:
            row.note = f"generated {len(r.token_ids)} tokens, not {TG}"
        if cuda:
            torch.cuda.synchronize()
            row.peak_alloc_gib = torch.cuda.max_memory_allocated() / GIB
            row.peak_reserved_gib = torch.cuda.max_memory_reserved() / GIB
    finally:
        del llm
        free_everything()
    return row


def time_prefill(llm, ids: list[int], cuda: bool, runs: int = 2) -> float:
    """Best tokens/s of `runs` prefills (the first also warms up allocations for this size);
    synchronises CUDA so queued GPU work is inside the timing."""
    best = 0.0
    for _ in range(runs):
        cache = llm.model.make_cache(len(ids) + 1)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.prefill(cache, ids)
        if cuda:
            torch.cuda.synchronize()
        best = max(best, len(ids) / (time.perf_counter() - t0))
        del cache
    return best


def cpu_reference(path: str, threads: int, prompt: list[int], ctx: int) -> np.ndarray:
    from hybridmoe import LLM, ComputeSettings, ContextSettings

    llm = LLM(path, compute=ComputeSettings(threads=threads), context=ContextSettings(ctx, PP, PP))  # all CPU
    try:
        return llm.logits(prompt[:LOGIT_TOKENS])
    finally:
        del llm
        free_everything()


def fmt(v: float | None, spec: str) -> str:
    return format("-", spec.split(".")[0]) if v is None else format(v, spec)


def print_table(rows: list[Row], title: str) -> None:
    print(f"\n{title}")
    head = (f"| {'placement':<16} | {'plan GiB Q8_0/f32':>17} | {'pp512 tok/s':>11} | "
            f"{'tg128 tok/s':>11} | {'peak alloc GiB':>14} | {'peak reserved GiB':>17} | "
            f"{'logits rel err / top1':>21} | {'load s':>6} | note")
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|---")
    for r in rows:
        lg = r.extra.get("logits")
        lgs = f"{lg['max_rel_err']:.1e} / {lg['top1_agree']:.2f}" if lg else "-"
        plan = f"{r.plan_gpu_gib:.2f} / {r.plan_gpu_f32_gib:.2f}"
        print(f"| {r.label:<16} | {plan:>17} | {fmt(r.pp_tok_s, '>11.1f')} | "
              f"{fmt(r.tg_tok_s, '>11.1f')} | {fmt(r.peak_alloc_gib, '>14.2f')} | "
              f"{fmt(r.peak_reserved_gib, '>17.2f')} | {lgs:>21} | {fmt(r.load_s, '>6.1f')} | {r.note}")


def run(preset: str, out_dir: str, threads: int, device: str, ctx: int) -> list[Row]:
    path = model_file(out_dir, preset, sparse=False)
    mf = open_model(path)
    vocab = GptOssConfig.from_metadata(mf.metadata).vocab_size
    mf.close()
    prompt = np.random.default_rng(0).integers(0, vocab, size=PP).tolist()
    t0 = time.perf_counter()
    ref = cpu_reference(path, threads, prompt, ctx)
    log(f"CPU reference logits [{LOGIT_TOKENS}, {vocab}] in {time.perf_counter() - t0:.1f} s")
    rows = []
    for label, options in CONFIGS:
        log(f"measuring {label} on {device}")
        rows.append(measure(path, label, options, ctx, threads, device, prompt, ref))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="20b", help="synthetic preset for the GPU run (default 20b)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--ctx", type=int, default=4096, help="context size for the runs")
    record.add_json_arg(ap)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    print(machine.describe())
    rec = record.new("gpu_check", {"preset": args.preset, "threads": args.threads, "ctx": args.ctx, "pp": PP, "tg": TG})
    rec["versions"]["cuda"] = torch.version.cuda
    log(f"torch {torch.__version__}, threads {args.threads}, CUDA {torch.cuda.is_available()}")

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        rows = run(args.preset, args.out, args.threads, "cuda:0", args.ctx)
        title = f"{args.preset}-shaped synthetic model on {name}, ctx {args.ctx}, {args.threads} CPU threads"
        rec["machine"]["gpu"] = name
    else:
        print("\nno CUDA device: GPU rows skipped. Plan predictions for the "
              f"{args.preset} shape (sparse header) and a CPU smoke run of this script on the tiny "
              "preset with every device 'cpu' follow.")
        sparse = model_file(args.out, args.preset, sparse=True)
        for label, options in CONFIGS:
            q8 = planned_gpu_gib(sparse, options, args.ctx, "cuda:0")
            f32 = planned_gpu_gib(sparse, options, args.ctx, "cuda:0", "f32")
            print(f"  plan {label:<16} GPU {q8:6.2f} GiB (dense weights Q8_0), {f32:6.2f} GiB (f32)")
        rows = run("tiny", args.out, args.threads, "cpu", args.ctx)
        title = "SMOKE (tiny preset, every device cpu; not a GPU measurement)"

    print_table(rows, title)
    rec["params"]["measured"] = title
    rec["rows"] = [{k: v for k, v in r.__dict__.items() if k != "extra"} | {
        "logits_max_rel_err": r.extra.get("logits", {}).get("max_rel_err"),
        "logits_top1_agree": r.extra.get("logits", {}).get("top1_agree")} for r in rows]
    record.write(rec, args.json)
    bad = [r.label for r in rows if not r.extra.get("logits", {}).get("ok", False)]
    log(f"total {time.perf_counter() - t_start:.0f} s")
    if bad:
        print(f"FAIL: logits differ from the CPU reference beyond rel {MAX_REL_ERR} "
              f"/ top-1 {MIN_TOP1}: {bad}")
        return 1
    print("PASS: placed-run logits match the CPU reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
