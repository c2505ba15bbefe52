"""hybridmoe vs llama.cpp (llama-cpp-python) on the same 20b-shaped synthetic GGUF, CPU only.

Same threads, same context, flash attention on for llama.cpp. Each run is a fresh child process
per engine (so peak RSS is that engine's own), engines alternating and their order flipped every
run. Reports medians: load time, first prefill after load, pp128 / pp512 prompt tok/s, tg64 decode
tok/s, peak RSS, ratios; for hybridmoe also the share of decode time spent inside kernel calls.
Before every child run the model file is dropped from the page cache and read back once,
sequentially (untimed), so that each engine starts with the whole file cached, the condition of
llama.cpp's "load ≈ 12 s" reference figure, and always in the same state. Without that, whichever
engine ran before decides how much of the file the next one re-reads from disk (llama.cpp's child
holds ~21 GiB) and how costly the cached pages are to map (a sequential read leaves large folios,
random page faults small ones: 6k vs 127k+ minor faults to map the 12 GB file on Linux 6.18).
`--cache as-is` skips it (cold-load numbers need a quiet box).

llama-cpp-python is a benchmark-only tool, never a runtime dependency:
    pip install llama-cpp-python==0.3.36        # compiles llama.cpp, 10+ minutes on 2 cores
    python bench/vs_llamacpp.py [--model M.gguf] [--threads 2] [--ctx 4096] [--runs 3]
Without --model it uses $HYBRIDMOE_BENCH_MODEL, then bench/out/synth-20b.gguf (made with
`hybridmoe synth --preset 20b` when missing; 12 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PP_SIZES = (128, 512)
TG_TOKENS = 64
WARMUP_TOKENS = 64  # one prefill right after load (page faults, thread start); timed apart


def _token_ids(n: int, vocab: int, seed: int) -> list[int]:
    import random

    rnd = random.Random(seed)
    return [rnd.randrange(1000, min(vocab, 199_000)) for _ in range(n)]


def _peak_rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def child_hybridmoe(model: str, threads: int, ctx: int, fast_math: bool = False) -> dict:
    from hybridmoe import LLM, ComputeSettings, ContextSettings
    from hybridmoe.models.gpt_oss import SeqChunk

    t0 = time.perf_counter()
    llm = LLM(model, compute=ComputeSettings(threads=threads, fast_math=fast_math),
              context=ContextSettings(ctx_size=ctx, ubatch_size=512))
    res = {"load_s": time.perf_counter() - t0}
    vocab = llm.config.vocab_size
    t = time.perf_counter()
    llm.prefill(llm.model.make_cache(ctx), _token_ids(WARMUP_TOKENS, vocab, 3))
    res["first_prefill_s"] = time.perf_counter() - t  # first touch of the mmap'd weights
    for n in PP_SIZES:
        cache = llm.model.make_cache(ctx)
        ids = _token_ids(n, vocab, n)
        t = time.perf_counter()
        llm.prefill(cache, ids)
        res[f"pp{n}"] = n / (time.perf_counter() - t)
    cache = llm.model.make_cache(ctx)
    llm.prefill(cache, _token_ids(8, vocab, 1))
    ids = _token_ids(TG_TOKENS, vocab, 2)
    kernel_s = _time_kernels()
    t = time.perf_counter()
    for tok in ids:
        llm.model.forward([SeqChunk(cache, [tok])])
    tg_s = time.perf_counter() - t
    res[f"tg{TG_TOKENS}"] = TG_TOKENS / tg_s
    res["tg_kernel_frac"] = kernel_s[0] / tg_s  # share of decode time inside the C kernels' calls
    res["peak_rss_gib"] = _peak_rss_gib()  # before the bandwidth probe's buffer
    res["tg_weight_gbs"] = _decode_bytes_per_token(llm) * TG_TOKENS / tg_s / 1e9
    res["read_bw_gbs"] = _read_bandwidth()
    return res


def _decode_bytes_per_token(llm) -> float:
    """Weight bytes one decode token reads: every tensor but the embedding (one row), and the
    routed experts' share k/E of each expert tensor."""
    cfg = llm.config
    total = 0.0
    for name, info in llm.file.tensors.items():
        if not name.startswith("token_embd"):
            total += info.nbytes * (cfg.n_experts_used / cfg.n_experts if "_exps" in name else 1)
    return total


def _read_bandwidth(gib: float = 2.0, repeats: int = 3) -> float:
    """GB/s of the kernel pool summing a touched buffer: the machine's read bandwidth right now."""
    import numpy as np

    from hybridmoe import kernels

    buf = np.ones(int(gib * 2**30) // 8, dtype=np.float64)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        kernels._lib_handle.hm_read_probe(buf.ctypes.data, buf.nbytes)
        times.append(time.perf_counter() - t)
    return buf.nbytes / statistics.median(times) / 1e9


def _time_kernels() -> list[float]:
    """Wraps the kernel entry points the model calls; returns a one-element accumulator of seconds."""
    from hybridmoe import kernels

    total = [0.0]
    targets = [(kernels, n) for n in ("moe_forward", "linear_q8_0", "linear_mxfp4", "attn_decode", "rms_norm")]
    targets.append((kernels.LinearGroup, "__call__"))  # the fused q/k/v call
    for owner, name in targets:
        fn = getattr(owner, name)

        def timed(*a, _fn=fn, **kw):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                total[0] += time.perf_counter() - t0

        setattr(owner, name, timed)
    return total


def child_llamacpp(model: str, threads: int, ctx: int) -> dict:
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=ctx, n_batch=512,
                n_ubatch=512, flash_attn=True, n_gpu_layers=0, verbose=False)
    res = {"load_s": time.perf_counter() - t0}
    vocab = llm.n_vocab()
    llm.reset()
    t = time.perf_counter()
    llm.eval(_token_ids(WARMUP_TOKENS, vocab, 3))
    res["first_prefill_s"] = time.perf_counter() - t
    for n in PP_SIZES:
        llm.reset()
        ids = _token_ids(n, vocab, n)
        t = time.perf_counter()
        llm.eval(ids)
        res[f"pp{n}"] = n / (time.perf_counter() - t)
    llm.reset()
    llm.eval(_token_ids(8, vocab, 1))
    ids = _token_ids(TG_TOKENS, vocab, 2)
    t = time.perf_counter()
    for tok in ids:
        llm.eval([tok])
    res[f"tg{TG_TOKENS}"] = TG_TOKENS / (time.perf_counter() - t)
    res["peak_rss_gib"] = _peak_rss_gib()
    return res


def child_hybridmoe_fast(model: str, threads: int, ctx: int) -> dict:
    """The opt-in --fast-math mode (int8 decode activations, as llama.cpp computes)."""
    return child_hybridmoe(model, threads, ctx, fast_math=True)


CHILDREN = {"hybridmoe": child_hybridmoe, "hybridmoe-fast": child_hybridmoe_fast, "llama.cpp": child_llamacpp}


def warm_page_cache(path: str, chunk: int = 16 << 20) -> tuple[float, float]:
    """Drops the file's cached pages, then reads it once sequentially; returns (GB, seconds)."""
    t = time.perf_counter()
    buf = bytearray(chunk)
    total = 0
    with open(path, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while n := f.readinto(buf):
            total += n
    return total / 1e9, time.perf_counter() - t


def run_child(engine: str, model: str, threads: int, ctx: int, timeout_s: float) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", engine, "--model", model,
           "--threads", str(threads), "--ctx", str(ctx)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"{engine} run failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(lines[-1])


def default_model() -> str:
    path = os.environ.get("HYBRIDMOE_BENCH_MODEL") or os.path.join(HERE, "out", "synth-20b.gguf")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        print(f"writing {path} (hybridmoe synth --preset 20b) ...", flush=True)
        subprocess.run([sys.executable, "-m", "hybridmoe.cli", "synth", "--preset", "20b", "--out", path], check=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--engines", nargs="+", default=list(CHILDREN), choices=list(CHILDREN))
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per child run")
    ap.add_argument("--cache", choices=["warm", "as-is"], default="warm",
                    help="warm: drop and re-read the model file before every child run (default); "
                         "as-is: leave the page cache")
    ap.add_argument("--child", choices=list(CHILDREN), help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        print(json.dumps(CHILDREN[args.child](args.model, args.threads, args.ctx)), flush=True)
        return

    model = args.model or default_model()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from machine import describe

    print(describe())
    print(f"model={model}  threads={args.threads}  ctx={args.ctx}  runs={args.runs} (alternating)"
          f"  page cache: {args.cache}", flush=True)
    results: dict[str, list[dict]] = {e: [] for e in args.engines}
    for run in range(args.runs):
        order = args.engines if run % 2 == 0 else args.engines[::-1]
        for engine in order:
            if args.cache == "warm":
                gb, secs = warm_page_cache(model)
                print(f"page cache warmed: {gb:.2f} GB read in {secs:.1f} s", flush=True)
            r = run_child(engine, model, args.threads, args.ctx, args.timeout)
            results[engine].append(r)
            print(f"run {run} {engine}: " + ", ".join(f"{k}={v:.2f}" for k, v in r.items()), flush=True)

    for rs in results.values():
        for r in rs:
            r["load_to_first_s"] = r["load_s"] + r["first_prefill_s"]
    keys = ["load_s", "first_prefill_s", "load_to_first_s", "pp128", "pp512", f"tg{TG_TOKENS}", "peak_rss_gib"]
    for e in [e for e in results if e.startswith("hybridmoe")]:
        frac = statistics.median(r["tg_kernel_frac"] for r in results[e])
        share = statistics.median(r["tg_weight_gbs"] / r["read_bw_gbs"] for r in results[e])
        gbs = statistics.median(r["tg_weight_gbs"] for r in results[e])
        print(f"{e} decode: {frac:.0%} of step time inside kernel calls; weights streamed at {gbs:.1f} GB/s "
              f"= {share:.0%} of the read bandwidth measured in the same child (median of per-run ratios)")
    med = {e: {k: statistics.median(r[k] for r in rs) for k in keys} for e, rs in results.items()}
    ours = [e for e in args.engines if e.startswith("hybridmoe")]
    ratio_cols = [e for e in ours if "llama.cpp" in med]
    print("\n| metric | " + " | ".join(args.engines) + "".join(f" | {e} / llama.cpp" for e in ratio_cols) + " |")
    print("|---" * (len(args.engines) + 1 + len(ratio_cols)) + "|")
    for k in keys:
        row = f"| {k} | " + " | ".join(f"{med[e][k]:.2f}" for e in args.engines)
        row += "".join(f" | {med[e][k] / med['llama.cpp'][k]:.2f}x" for e in ratio_cols)
        print(row + " |")
    print(f"(pp/tg in tok/s, higher is better; seconds and GiB lower is better; first_prefill_s ="
          f" the first {WARMUP_TOKENS}-token prefill after load, which pays for first-touch page faults)")


if __name__ == "__main__":
    main()
