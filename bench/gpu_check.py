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
import traceback
from dataclasses import dataclass, field

import numpy as np
import torch

import machine
import record
from hybridmoe.gguf.reader import open_model
from hybridmoe.gpt_oss_config import GptOssConfig
from hybridmoe.placement import PlacementOptions, make_plan
from hybridmoe.placement.plan import Plan
from hybridmoe.settings import PlacementSettings
from hybridmoe.synth import write_synthetic

GIB = 1 << 30
CONFIGS = [  # (label, LLM placement options, --fast-math); n_gpu_layers=999 = everything on the GPU
    ("--cpu-moe", {"cpu_moe": True}, False),
    ("--n-cpu-moe 12", {"n_cpu_moe": 12}, False),
    ("all on GPU", {"n_gpu_layers": 999}, False),
    # Same as --cpu-moe with prompt batches kept on the CPU kernels: is streaming worth it here?
    ("--cpu-moe, no stream", {"cpu_moe": True, "upload_buffers": 0}, False),
    ("--cpu-moe --fast-math", {"cpu_moe": True}, True),
    ("all on GPU, fast-math", {"n_gpu_layers": 999}, True),
]
PP, TG = 512, 128
LOGIT_TOKENS = 32
# The default (exact) GPU numerics are float32 like the CPU path, so they must keep its promise:
# 1e-3 relative and the same argmax everywhere. --fast-math rows (bf16, f16 KV) are reported only:
# on a random model a rounding that flips one token's expert choice changes later logits a lot.
MAX_REL_ERR, MIN_TOP1 = 1e-3, 1.0


@dataclass
class Row:
    label: str
    plan_gpu_gib: float  # the run's plan: GPU total (its dense dtype and KV bytes are in the note)
    plan_small_gib: float  # the same placement with dense weights as stored (Q8_0) and an f16 cache
    pp_tok_s: float | None = None
    tg_tok_s: float | None = None
    peak_alloc_gib: float | None = None
    peak_reserved_gib: float | None = None
    load_s: float | None = None
    fast_math: bool = False
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


def planned_gpu_gib(path: str, options: dict, ctx: int, device: str, dense: str = "stored",
                    kv_bytes: float = 2.0) -> float:
    mf = open_model(path)
    try:
        cfg = GptOssConfig.from_metadata(mf.metadata)
        plan = make_plan(cfg, mf.tensors, PlacementOptions(
            PlacementSettings(gpu_device=device, gpu_dense_dtype=dense, **options), ctx_size=ctx, batch_size=PP,
            kv_dtype_bytes=kv_bytes))
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
    return {"max_rel_err": rel, "top1_agree": top1, "ok": rel <= MAX_REL_ERR and top1 >= MIN_TOP1,
            "finite": bool(np.isfinite(got).all())}


def measure(path: str, label: str, options: dict, fast_math: bool, ctx: int, threads: int, device: str,
            prompt: list[int], ref_logits: np.ndarray) -> Row:
    from hybridmoe import LLM, ComputeSettings, ContextSettings, PlacementSettings

    row = Row(label, 0.0, planned_gpu_gib(path, options, ctx, device), fast_math=fast_math)
    cuda = device.startswith("cuda")
    if cuda:
        free_everything()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    llm = LLM(path, compute=ComputeSettings(threads=threads, fast_math=fast_math),
              context=ContextSettings(ctx, PP, PP), placement=PlacementSettings(gpu_device=device, **options))
    plan = llm.model.placement
    if isinstance(plan, Plan):
        row.plan_gpu_gib = plan.devices[plan.gpu_device].total_bytes / GIB if plan.gpu_device in plan.devices else 0.0
        row.note = "; ".join(n.split(" (")[0] for n in plan.notes)
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

    # gpu_device="cpu": with CUDA present the default placement would put every layer on the GPU.
    llm = LLM(path, compute=ComputeSettings(threads=threads), context=ContextSettings(ctx, PP, PP),
              placement=PlacementSettings(gpu_device="cpu"))
    try:
        return llm.logits(prompt[:LOGIT_TOKENS])
    finally:
        del llm
        free_everything()


def fmt(v: float | None, spec: str) -> str:
    return format("-", spec.split(".")[0]) if v is None else format(v, spec)


def _passes(r: Row) -> bool:
    lg = r.extra.get("logits")
    if lg is None:
        return False
    return lg["finite"] if r.fast_math else lg["ok"]


def row_record(r: Row) -> dict:
    lg = r.extra.get("logits", {})
    return {k: v for k, v in r.__dict__.items() if k != "extra"} | {
        "logits_max_rel_err": lg.get("max_rel_err"), "logits_top1_agree": lg.get("top1_agree")}


def print_table(rows: list[Row], title: str) -> None:
    print(f"\n{title}")
    head = (f"| {'placement':<21} | {'plan GiB run/Q8_0+f16':>21} | {'pp512 tok/s':>11} | "
            f"{'tg128 tok/s':>11} | {'peak alloc GiB':>14} | {'peak reserved GiB':>17} | "
            f"{'logits rel err / top1':>21} | {'load s':>6} | note")
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|---")
    for r in rows:
        lg = r.extra.get("logits")
        lgs = f"{lg['max_rel_err']:.1e} / {lg['top1_agree']:.2f}" if lg else "-"
        plan = f"{r.plan_gpu_gib:.2f} / {r.plan_small_gib:.2f}"
        print(f"| {r.label:<21} | {plan:>21} | {fmt(r.pp_tok_s, '>11.1f')} | "
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
    for label, options, fast_math in CONFIGS:
        log(f"measuring {label} on {device}")
        try:
            rows.append(measure(path, label, options, fast_math, ctx, threads, device, prompt, ref))
            r, lg = rows[-1], rows[-1].extra.get("logits", {})
            log(f"  {label}: pp{PP} {fmt(r.pp_tok_s, '.1f')} tok/s, tg{TG} {fmt(r.tg_tok_s, '.1f')} tok/s, "
                f"peak {fmt(r.peak_alloc_gib, '.2f')} GiB, logits rel err {lg.get('max_rel_err', float('nan')):.1e} "
                f"top1 {lg.get('top1_agree', float('nan')):.2f}; {r.note}")
        except Exception as e:  # one broken placement must not hide the others' figures
            traceback.print_exc()
            rows.append(Row(label, float("nan"), float("nan"), fast_math=fast_math,
                            note=f"error: {type(e).__name__}: {e}"[:200]))
            free_everything()
    return rows


def stream_cost_inputs(path: str, device: str, reps: int = 5) -> dict[str, float]:
    """What models.experts_streamed.StreamCost assumes, measured on this machine (medians):
    pinned host -> device copy GB/s, mmap -> pinned gather GB/s (one thread, as the streamer
    does), and bf16 TFLOP/s of one expert's matmul at 64 rows."""
    import statistics

    mf = open_model(path)
    try:
        gate = mf.raw("blk.0.ffn_gate_exps.weight") if "blk.0.ffn_gate_exps.weight" in mf.tensors else \
            mf.raw("blk.0.ffn_gate_up_exps.weight")
        n = gate.shape[0]
        host = torch.empty(gate.shape, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(gate.shape, dtype=torch.uint8, device=device)
        idx = np.arange(n)
        gather, h2d = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            np.take(gate, idx, axis=0, out=host.numpy(), mode="clip")
            gather.append(host.numel() / (time.perf_counter() - t0) / 1e9)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            h2d.append(host.numel() / (time.perf_counter() - t0) / 1e9)
        cfg = GptOssConfig.from_metadata(mf.metadata)
    finally:
        mf.close()
    H, I = cfg.hidden, cfg.expert_ffn
    x = torch.randn(64, H, device=device, dtype=torch.bfloat16)
    w = torch.randn(I, H, device=device, dtype=torch.bfloat16)
    flops = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(100):
            x @ w.T
        torch.cuda.synchronize()
        flops.append(100 * 2 * 64 * H * I / (time.perf_counter() - t0) / 1e12)
    del host, dev, x, w
    free_everything()
    return {"pcie_gbps": statistics.median(h2d), "host_copy_gbps": statistics.median(gather),
            "gpu_tflops": statistics.median(flops), "bytes": float(gate.nbytes)}


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

    checked: list[Row] = []
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        if args.preset != "tiny":  # seconds: a broken GPU path shows here before the big file is written
            tiny = run("tiny", args.out, args.threads, "cuda:0", args.ctx)
            print_table(tiny, f"tiny preset on {name} (quick check before the {args.preset} file)")
            rec["tiny_rows"] = [row_record(r) for r in tiny]
            checked += tiny
        rows = run(args.preset, args.out, args.threads, "cuda:0", args.ctx)
        try:
            sc = stream_cost_inputs(model_file(args.out, args.preset, sparse=False), "cuda:0")
            rec["stream_cost"] = sc
            print(f"\nStreamCost inputs measured here (one layer's gate experts, {sc['bytes'] / GIB:.2f} GiB; "
                  f"defaults in models/experts_streamed.py): pinned->GPU {sc['pcie_gbps']:.1f} GB/s, "
                  f"mmap->pinned gather (1 thread) {sc['host_copy_gbps']:.1f} GB/s, bf16 64-row expert "
                  f"matmul {sc['gpu_tflops']:.1f} TFLOP/s")
        except Exception:
            traceback.print_exc()
        title = f"{args.preset}-shaped synthetic model on {name}, ctx {args.ctx}, {args.threads} CPU threads"
        rec["machine"]["gpu"] = name
    else:
        print("\nno CUDA device: GPU rows skipped. Plan predictions for the "
              f"{args.preset} shape (sparse header) and a CPU smoke run of this script on the tiny "
              "preset with every device 'cpu' follow.")
        sparse = model_file(args.out, args.preset, sparse=True)
        for label, options, _ in CONFIGS:
            q8 = planned_gpu_gib(sparse, options, args.ctx, "cuda:0", "stored")
            f32 = planned_gpu_gib(sparse, options, args.ctx, "cuda:0", "f32", 4.0)
            print(f"  plan {label:<21} GPU {q8:6.2f} GiB (dense Q8_0, f16 KV), {f32:6.2f} GiB (f32, f32 KV)")
        rows = run("tiny", args.out, args.threads, "cpu", args.ctx)
        title = "SMOKE (tiny preset, every device cpu; not a GPU measurement)"

    print_table(rows, title)
    rec["params"]["measured"] = title
    rec["rows"] = [row_record(r) for r in rows]
    record.write(rec, args.json)
    bad = [r.label for r in checked + rows if not _passes(r)]
    log(f"total {time.perf_counter() - t_start:.0f} s")
    if bad:
        print(f"FAIL: logits differ from the CPU reference beyond rel {MAX_REL_ERR} / top-1 {MIN_TOP1} "
              f"(fast-math rows: not finite) or the run failed: {bad}")
        return 1
    print("PASS: placed-run logits match the CPU reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
