"""hybridmoe vs llama.cpp on the same GGUF (by default a 20b-shaped synthetic file), CPU only.

Same file, same threads, flash attention on for llama.cpp. Each run is a fresh child process per
engine (so peak RSS is that engine's own), engines alternating and their order flipped every run.
Reports medians: load time, first prefill after load, pp128 / pp512 prompt tok/s, tg64 decode
tok/s, peak RSS, ratios; for hybridmoe also the share of decode time spent inside kernel calls.

llama.cpp is driven through whichever is present, and the output says which and its version:
  1. `llama-bench` built from source (the newest llama.cpp): --llama-bench PATH, or the
     llama-bench beside --llama-server PATH, or $HYBRIDMOE_LLAMA_BENCH / $HYBRIDMOE_LLAMA_SERVER,
     or `llama-bench` on $PATH. It measures pp/tg itself (`-p 128,512 -n 64 -fa on -ngl 0 -b 512
     -ub 512 -r 1` per run); it reports no load time.
  2. the llama-cpp-python package (`pip install llama-cpp-python`; a benchmark tool, never a
     runtime dependency), timed here like hybridmoe.

Before every child run the model file is dropped from the page cache and read back once,
sequentially (untimed), so each engine starts with the whole file cached and in the same state
(whichever engine ran before would otherwise decide how much the next re-reads from disk and how
costly the cached pages are to map). `--cache as-is` skips it (cold-load numbers need a quiet box).

    python bench/vs_llamacpp.py [--model M.gguf] [--threads 2] [--ctx 4096] [--runs 3] [--json out.json]
Without --model it uses $HYBRIDMOE_BENCH_MODEL, then bench/out/synth-20b.gguf (made with
`hybridmoe synth --preset 20b` when missing; 12 GB).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import machine
import record

HERE = os.path.dirname(os.path.abspath(__file__))
PP_SIZES = (128, 512)
TG_TOKENS = 64
WARMUP_TOKENS = 64  # one prefill right after load (page faults, thread start); timed apart


def _token_ids(n: int, vocab: int, seed: int) -> list[int]:
    import random

    rnd = random.Random(seed)
    return [rnd.randrange(min(1000, vocab // 2), min(vocab, 199_000)) for _ in range(n)]


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
    targets = [(kernels, n) for n in ("moe_forward", "linear_quantized", "linear_q8_0", "linear_mxfp4", "attn_decode",
                                      "rms_norm")]
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


def child_llamacpp_python(model: str, threads: int, ctx: int) -> dict:
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


def child_llama_bench(binary: str, model: str, threads: int) -> dict:
    """One llama-bench process (one repetition after its warm-up); its peak RSS is this child's
    only waited-for child's, so RUSAGE_CHILDREN gives it."""
    import resource

    cmd = [binary, "-m", model, "-t", str(threads), "-p", ",".join(str(n) for n in PP_SIZES), "-n", str(TG_TOKENS),
           "-fa", "on", "-ngl", "0", "-b", "512", "-ub", "512", "-r", "1", "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
    res: dict = {}
    for test in json.loads(r.stdout):
        name = f"pp{test['n_prompt']}" if test["n_gen"] == 0 else f"tg{test['n_gen']}"
        res[name] = test["avg_ts"]
    res["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    return res


ENGINES = ("hybridmoe", "hybridmoe-fast", "llama.cpp")  # hybridmoe-fast: --fast-math (int8 activations)
KEYS = ["load_s", "first_prefill_s", "load_to_first_s", *(f"pp{n}" for n in PP_SIZES), f"tg{TG_TOKENS}",
        "peak_rss_gib"]


@dataclass(frozen=True)
class LlamaCpp:
    """How llama.cpp is run here: the llama-bench binary at `path`, or the llama-cpp-python package."""

    driver: str  # "llama-bench" | "llama-cpp-python"
    path: str | None
    version: str


def _llama_bench_version(path: str) -> str:
    r = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    lines = [ln.strip() for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    return "; ".join(lines[:2]) or "unknown"


def find_llamacpp(llama_bench: str | None, llama_server: str | None) -> LlamaCpp | None:
    """The llama.cpp to compare with: a llama-bench binary (explicit, beside llama-server, from
    the environment, on $PATH) before the llama-cpp-python package, whose bundled llama.cpp lags."""
    candidates = [llama_bench, llama_server and os.path.join(os.path.dirname(llama_server), "llama-bench"),
                  os.environ.get("HYBRIDMOE_LLAMA_BENCH"),
                  os.environ.get("HYBRIDMOE_LLAMA_SERVER")
                  and os.path.join(os.path.dirname(os.environ["HYBRIDMOE_LLAMA_SERVER"]), "llama-bench"),
                  shutil.which("llama-bench")]
    explicit = [c for c in candidates[:2] if c]
    for c in explicit[:1] or candidates:  # a path given on the command line is the only candidate
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return LlamaCpp("llama-bench", os.path.abspath(c), _llama_bench_version(c))
    if explicit:
        raise SystemExit(f"no executable llama-bench at {explicit[0]}")
    if importlib.util.find_spec("llama_cpp") is not None:
        return LlamaCpp("llama-cpp-python", None, importlib.metadata.version("llama_cpp_python"))
    return None


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


def run_child(engine: str, model: str, threads: int, ctx: int, timeout_s: float, llama: LlamaCpp | None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", engine, "--model", model,
           "--threads", str(threads), "--ctx", str(ctx)]
    if engine == "llama.cpp" and llama is not None and llama.driver == "llama-bench":
        cmd += ["--llama-bench", llama.path]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"{engine} run failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(lines[-1])


def run_child_here(engine: str, args: argparse.Namespace) -> dict:
    if engine == "llama.cpp":
        if args.llama_bench:
            return child_llama_bench(args.llama_bench, args.model, args.threads)
        return child_llamacpp_python(args.model, args.threads, args.ctx)
    return child_hybridmoe(args.model, args.threads, args.ctx, fast_math=engine == "hybridmoe-fast")


def default_model() -> str:
    path = os.environ.get("HYBRIDMOE_BENCH_MODEL") or os.path.join(HERE, "out", "synth-20b.gguf")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        print(f"writing {path} (hybridmoe synth --preset 20b) ...", flush=True)
        subprocess.run([sys.executable, "-m", "hybridmoe.cli", "synth", "--preset", "20b", "--out", path], check=True)
    return path


def _median(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(results: dict[str, list[dict]], engines: list[str]) -> tuple[list[dict], list[str]]:
    """Table rows (one per metric: each engine's median, each hybridmoe mode / llama.cpp) and the
    hybridmoe decode lines (kernel share, weight stream vs read bandwidth)."""
    for rs in results.values():
        for r in rs:
            if "load_s" in r and "first_prefill_s" in r:
                r["load_to_first_s"] = r["load_s"] + r["first_prefill_s"]
    med = {e: {k: _median([r.get(k) for r in rs]) for k in KEYS} for e, rs in results.items()}
    ours = [e for e in engines if e.startswith("hybridmoe")]
    rows = []
    for k in KEYS:
        row: dict = {"metric": k}
        row.update({e: med[e][k] for e in engines})
        if "llama.cpp" in med:
            for e in ours:
                theirs = med["llama.cpp"][k]
                row[f"{e} / llama.cpp"] = None if theirs is None or med[e][k] is None else med[e][k] / theirs
        rows.append(row)
    lines = []
    stream: dict = {"metric": "tg weight stream (GB/s)"}
    share_row: dict = {"metric": "tg weight stream / read bandwidth"}
    for e in ours:
        frac = _median([r["tg_kernel_frac"] for r in results[e]])
        share = _median([r["tg_weight_gbs"] / r["read_bw_gbs"] for r in results[e]])
        gbs = _median([r["tg_weight_gbs"] for r in results[e]])
        lines.append(f"{e} decode: {frac:.0%} of step time inside kernel calls; weights streamed at {gbs:.1f} GB/s "
                     f"= {share:.0%} of the read bandwidth measured in the same child (median of per-run ratios)")
        stream[e], share_row[e] = gbs, share
    return rows + ([stream, share_row] if ours else []), lines


def _fmt(v: float | None, ratio: bool = False) -> str:
    return "-" if v is None else f"{v:.2f}x" if ratio else f"{v:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096, help="context of the hybridmoe and llama-cpp-python runs")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    ap.add_argument("--llama-bench", metavar="PATH", help="llama.cpp's llama-bench binary (default: see above)")
    ap.add_argument("--llama-server", metavar="PATH", help="use the llama-bench beside this llama-server")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per child run")
    ap.add_argument("--cache", choices=["warm", "as-is"], default="warm",
                    help="warm: drop and re-read the model file before every child run (default); "
                         "as-is: leave the page cache")
    record.add_json_arg(ap)
    ap.add_argument("--child", choices=list(ENGINES), help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        print(json.dumps(run_child_here(args.child, args)), flush=True)
        return

    model = args.model or default_model()
    engines = list(args.engines)
    llama = find_llamacpp(args.llama_bench, args.llama_server) if "llama.cpp" in engines else None
    print(machine.describe())
    if "llama.cpp" in engines and llama is None:
        print("llama.cpp: none found (no llama-bench, no llama-cpp-python); comparing hybridmoe alone")
        engines.remove("llama.cpp")
    elif llama is not None:
        print(f"llama.cpp: {llama.driver} {llama.version}" + (f" at {llama.path}" if llama.path else ""))
    print(f"model={model}  threads={args.threads}  ctx={args.ctx}  runs={args.runs} (alternating)"
          f"  page cache: {args.cache}", flush=True)
    rec = record.new("vs_llamacpp", {
        "model": os.path.basename(model), "model_gb": round(os.path.getsize(model) / 1e9, 2),
        "threads": args.threads, "ctx": args.ctx, "runs": args.runs, "engines": engines, "page_cache": args.cache})
    if llama is not None:
        rec["versions"]["llama.cpp"] = {"driver": llama.driver, "version": llama.version}
    results: dict[str, list[dict]] = {e: [] for e in engines}
    for run in range(args.runs):
        order = engines if run % 2 == 0 else engines[::-1]
        for engine in order:
            if args.cache == "warm":
                gb, secs = warm_page_cache(model)
                print(f"page cache warmed: {gb:.2f} GB read in {secs:.1f} s", flush=True)
            r = run_child(engine, model, args.threads, args.ctx, args.timeout, llama)
            results[engine].append(r)
            rec["runs"].append({"run": run, "engine": engine, **r})
            print(f"run {run} {engine}: " + ", ".join(f"{k}={v:.2f}" for k, v in r.items()), flush=True)

    rows, lines = summarize(results, engines)
    for line in lines:
        print(line)
    cols = [c for c in rows[0] if c != "metric"]
    print("\n| metric | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for row in rows[: len(KEYS)]:
        print(f"| {row['metric']} | " + " | ".join(_fmt(row.get(c), "/" in c) for c in cols) + " |")
    print(f"(pp/tg in tok/s, higher is better; seconds and GiB lower is better; first_prefill_s ="
          f" the first {WARMUP_TOKENS}-token prefill after load, which pays for first-touch page faults"
          + ("; llama-bench reports no load time" if llama and llama.driver == "llama-bench" else "") + ")")
    rec["rows"] = rows
    record.write(rec, args.json)


if __name__ == "__main__":
    main()
