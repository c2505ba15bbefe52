"""hybridmoe vs llama.cpp on the same GGUF (by default a 20b-shaped synthetic file), CPU only,
each engine at its best.

Same file, same threads, flash attention on for llama.cpp. Each run is a fresh child process per
engine, engines alternating and their order flipped every run. Inside a child every engine
measures the same way: one warm-up (llama-bench's own; ours a 64-token prefill and 8 decode steps),
then `--reps` repetitions of pp128, pp512 and tg64 (llama-bench `-r REPS`). Reported per engine
and metric: min / median / max over all repetitions of all runs, and the ratios of the medians and
of the bests (tok/s max, seconds and GiB min).

Per child the record also keeps what memory it had: how much of the model file was in the page
cache when it started (`fincore`), its peak resident file pages and anonymous memory (sampled from
/proc), and how busy the rest of the machine was while it ran (CPU time of other processes, in
cores), and how much of the page cache the kernel evicted and read back meanwhile (refaults: a
VM's memory manager may page the file out under a running engine); a child with more than 0.25
cores of other work or 0.25 GiB of refaults is marked busy and the table says so.

Page cache (`--cache`): `warm` (default) reads the file once before the first child and leaves
it: each engine then meets the cache as the others left it, which is how a user runs; `drop`
drops and re-reads it before every child; `as-is` leaves it alone (cold loads need a quiet box).

llama.cpp is driven through whichever is present, and the output says which and its version:
  1. `llama-bench` built from source (the newest llama.cpp): --llama-bench PATH, or the
     llama-bench beside --llama-server PATH, or $HYBRIDMOE_LLAMA_BENCH / $HYBRIDMOE_LLAMA_SERVER,
     or `llama-bench` on $PATH (`-p 128,512 -n 64 -fa on -ngl 0 -b 512 -ub 512 -r REPS`; it
     reports no load time).
  2. the llama-cpp-python package (`pip install llama-cpp-python`; a benchmark tool, never a
     runtime dependency), timed here like hybridmoe.

    python bench/vs_llamacpp.py [--model M.gguf] [--threads 2] [--ctx 4096] [--runs 3] [--reps 3] [--json out.json]
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
import threading
import time
from dataclasses import dataclass

import machine
import record

HERE = os.path.dirname(os.path.abspath(__file__))
PP_SIZES = (128, 512)
TG_TOKENS = 64
WARMUP_TOKENS = 64  # one prefill right after load (page faults, thread start); timed apart
RATE_KEYS = [*(f"pp{n}" for n in PP_SIZES), f"tg{TG_TOKENS}"]  # tok/s, one value per repetition
BUSY_CORES = 0.25  # other processes' CPU use (in cores) above which a child's run is marked busy
REFAULT_GIB = 0.25  # file pages re-read after eviction during a child above which it is marked busy


def _token_ids(n: int, vocab: int, seed: int) -> list[int]:
    import random

    rnd = random.Random(seed)
    return [rnd.randrange(min(1000, vocab // 2), min(vocab, 199_000)) for _ in range(n)]


def _status_kib(pid: int | str = "self") -> dict[str, int]:
    """VmHWM / RssAnon / RssFile of a process in KiB (empty once it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key in ("VmHWM", "RssAnon", "RssFile"):
                    out[key] = int(val.split()[0])
    except OSError:
        pass
    return out


class MemoryWatch:
    """Samples a process's resident anonymous and file-backed memory every 0.2 s; keeps the peaks."""

    def __init__(self, pid: int | str = "self"):
        self.pid, self.peak = pid, {"RssAnon": 0, "RssFile": 0, "VmHWM": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(0.2):
                return

    def sample(self) -> None:
        for k, v in _status_kib(self.pid).items():
            self.peak[k] = max(self.peak[k], v)

    def stop(self) -> dict[str, float]:
        self.sample()
        self._stop.set()
        self._thread.join()
        return {"peak_rss_gib": self.peak["VmHWM"] / 2**20, "anon_gib": self.peak["RssAnon"] / 2**20,
                "file_rss_gib": self.peak["RssFile"] / 2**20}


def cached_gib(path: str) -> float | None:
    """How much of `path` is in the page cache now (util-linux `fincore`), or None without it."""
    try:
        r = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", path], capture_output=True,
                           text=True, timeout=60)
        return int(r.stdout.split()[0]) / 2**30 if r.returncode == 0 and r.stdout.split() else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def refaulted_gib() -> float:
    """File pages the kernel has read back soon after evicting them, since boot (/proc/vmstat
    workingset_refault_file, 4 KiB pages): a child during which this grows re-read weights from disk."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("workingset_refault_file "):
                    return int(line.split()[1]) * 4096 / 2**30
    except OSError:
        pass
    return 0.0


def _busy_jiffies() -> int:
    """Non-idle CPU time of the whole machine so far, in clock ticks."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    return sum(vals) - vals[3] - vals[4]  # minus idle and iowait


def child_hybridmoe(model: str, threads: int, ctx: int, reps: int, fast_math: bool = False) -> dict:
    from hybridmoe import LLM, ComputeSettings, ContextSettings
    from hybridmoe.models.gpt_oss import SeqChunk

    watch = MemoryWatch()
    t0 = time.perf_counter()
    llm = LLM(model, compute=ComputeSettings(threads=threads, fast_math=fast_math),
              context=ContextSettings(ctx_size=ctx, ubatch_size=512))
    res: dict = {"load_s": time.perf_counter() - t0}
    vocab = llm.config.vocab_size
    t = time.perf_counter()
    llm.prefill(llm.model.make_cache(ctx), _token_ids(WARMUP_TOKENS, vocab, 3))
    res["first_prefill_s"] = time.perf_counter() - t  # first touch of the mmap'd weights

    def decode(cache, ids: list[int]) -> float:
        t = time.perf_counter()
        for tok in ids:
            llm.model.forward([SeqChunk(cache, [tok])])
        return time.perf_counter() - t

    warm = llm.model.make_cache(ctx)
    llm.prefill(warm, _token_ids(8, vocab, 1))
    decode(warm, _token_ids(8, vocab, 4))  # the decode path's own warm-up (as llama-bench's)
    samples: dict[str, list[float]] = {k: [] for k in RATE_KEYS}
    kernel_s = _time_kernels()
    tg_s, tg_kernel_s = 0.0, 0.0
    for rep in range(reps):
        for n in PP_SIZES:
            cache = llm.model.make_cache(ctx)
            ids = _token_ids(n, vocab, n + rep)
            t = time.perf_counter()
            llm.prefill(cache, ids)
            samples[f"pp{n}"].append(n / (time.perf_counter() - t))
        cache = llm.model.make_cache(ctx)
        llm.prefill(cache, _token_ids(8, vocab, 1))
        k0 = kernel_s[0]
        secs = decode(cache, _token_ids(TG_TOKENS, vocab, 2 + rep))
        tg_s, tg_kernel_s = tg_s + secs, tg_kernel_s + kernel_s[0] - k0
        samples[f"tg{TG_TOKENS}"].append(TG_TOKENS / secs)
    res["samples"] = samples
    res["tg_kernel_frac"] = tg_kernel_s / tg_s  # share of decode time inside the C kernels' calls
    res.update(watch.stop())  # before the bandwidth probe's buffer
    res["tg_weight_gbs"] = _decode_bytes_per_token(llm) * TG_TOKENS * reps / tg_s / 1e9
    res["read_bw_gbs"] = machine.read_bandwidth(threads)[0]
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


def child_llamacpp_python(model: str, threads: int, ctx: int, reps: int) -> dict:
    from llama_cpp import Llama

    watch = MemoryWatch()
    t0 = time.perf_counter()
    llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=ctx, n_batch=512,
                n_ubatch=512, flash_attn=True, n_gpu_layers=0, verbose=False)
    res: dict = {"load_s": time.perf_counter() - t0}
    vocab = llm.n_vocab()
    llm.reset()
    t = time.perf_counter()
    llm.eval(_token_ids(WARMUP_TOKENS, vocab, 3))
    res["first_prefill_s"] = time.perf_counter() - t
    samples: dict[str, list[float]] = {k: [] for k in RATE_KEYS}
    for rep in range(reps):
        for n in PP_SIZES:
            llm.reset()
            ids = _token_ids(n, vocab, n + rep)
            t = time.perf_counter()
            llm.eval(ids)
            samples[f"pp{n}"].append(n / (time.perf_counter() - t))
        llm.reset()
        llm.eval(_token_ids(8, vocab, 1))
        t = time.perf_counter()
        for tok in _token_ids(TG_TOKENS, vocab, 2 + rep):
            llm.eval([tok])
        samples[f"tg{TG_TOKENS}"].append(TG_TOKENS / (time.perf_counter() - t))
    res["samples"] = samples
    res.update(watch.stop())
    return res


def child_llama_bench(binary: str, model: str, threads: int, reps: int) -> dict:
    """One llama-bench process (its warm-up, then `reps` repetitions of each test), its memory
    sampled from /proc while it runs."""
    cmd = [binary, "-m", model, "-t", str(threads), "-p", ",".join(str(n) for n in PP_SIZES), "-n", str(TG_TOKENS),
           "-fa", "on", "-ngl", "0", "-b", "512", "-ub", "512", "-r", str(reps), "-o", "json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watch = MemoryWatch(proc.pid)
    out, err = proc.communicate()
    mem = watch.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed (rc {proc.returncode}):\n{err[-3000:]}")
    samples: dict[str, list[float]] = {}
    for test in json.loads(out):
        name = f"pp{test['n_prompt']}" if test["n_gen"] == 0 else f"tg{test['n_gen']}"
        samples[name] = list(test.get("samples_ts") or [test["avg_ts"]])
    return {"samples": samples, **mem}


ENGINES = ("hybridmoe", "hybridmoe-fast", "llama.cpp")  # hybridmoe-fast: --fast-math (int8 activations)
KEYS = ["load_s", "first_prefill_s", "load_to_first_s", *RATE_KEYS, "peak_rss_gib", "anon_gib", "file_rss_gib"]
LOWER_IS_BETTER = {"load_s", "first_prefill_s", "load_to_first_s", "peak_rss_gib", "anon_gib", "file_rss_gib"}


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


def warm_page_cache(path: str, drop: bool, chunk: int = 16 << 20) -> tuple[float, float]:
    """Reads the file once sequentially (after dropping its cached pages when `drop`); returns
    (GB, seconds)."""
    t = time.perf_counter()
    buf = bytearray(chunk)
    total = 0
    with open(path, "rb", buffering=0) as f:
        if drop:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while n := f.readinto(buf):
            total += n
    return total / 1e9, time.perf_counter() - t


def run_child(engine: str, model: str, args: argparse.Namespace, llama: LlamaCpp | None) -> dict:
    """One child run, with the page-cache state it met, the load average before it and the CPU
    time other processes spent while it ran."""
    import resource

    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), OMP_WAIT_POLICY="PASSIVE")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", engine, "--model", model,
           "--threads", str(args.threads), "--ctx", str(args.ctx), "--reps", str(args.reps)]
    if engine == "llama.cpp" and llama is not None and llama.driver == "llama-bench":
        cmd += ["--llama-bench", llama.path]
    facts = {"cached_gib_at_start": cached_gib(model), "load_avg_before": machine.load_average()}
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy0, refault0, t0 = _busy_jiffies(), refaulted_gib(), time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    facts["refaulted_gib"] = refaulted_gib() - refault0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    other = (_busy_jiffies() - busy0) / os.sysconf("SC_CLK_TCK") - own
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"{engine} run failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
    facts["other_cores"] = max(0.0, other / wall)
    facts["busy"] = facts["other_cores"] > BUSY_CORES or facts["refaulted_gib"] > REFAULT_GIB
    return {**json.loads(lines[-1]), **facts}


def run_child_here(engine: str, args: argparse.Namespace) -> dict:
    if engine == "llama.cpp":
        if args.llama_bench:
            return child_llama_bench(args.llama_bench, args.model, args.threads, args.reps)
        return child_llamacpp_python(args.model, args.threads, args.ctx, args.reps)
    return child_hybridmoe(args.model, args.threads, args.ctx, args.reps, fast_math=engine == "hybridmoe-fast")


def default_model() -> str:
    path = os.environ.get("HYBRIDMOE_BENCH_MODEL") or os.path.join(HERE, "out", "synth-20b.gguf")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        print(f"writing {path} (hybridmoe synth --preset 20b) ...", flush=True)
        subprocess.run([sys.executable, "-m", "hybridmoe.cli", "synth", "--preset", "20b", "--out", path], check=True)
    return path


def values(runs: list[dict], key: str) -> list[float]:
    """Every measurement of `key` in an engine's runs: all repetitions of a rate, one per run else."""
    out: list[float] = []
    for r in runs:
        if key in r.get("samples", {}):
            out += r["samples"][key]
        elif key == "load_to_first_s" and "load_s" in r and "first_prefill_s" in r:
            out.append(r["load_s"] + r["first_prefill_s"])
        elif r.get(key) is not None:
            out.append(r[key])
    return out


def _best(vals: list[float], key: str) -> float:
    return min(vals) if key in LOWER_IS_BETTER else max(vals)


def summarize(results: dict[str, list[dict]], engines: list[str]) -> tuple[list[dict], list[str]]:
    """Table rows (one per metric: each engine's median and its min-max, the hybridmoe modes over
    llama.cpp by median and by best) and the hybridmoe decode lines (kernel share, weight stream
    vs read bandwidth)."""
    ours = [e for e in engines if e.startswith("hybridmoe")]
    rows = []
    for k in KEYS:
        vals = {e: values(results[e], k) for e in engines}
        row: dict = {"metric": k}
        for e in engines:
            v = vals[e]
            row[e] = statistics.median(v) if v else None
            row[f"{e} min-max"] = f"{min(v):.2f}-{max(v):.2f}" if len(v) > 1 else None
        if "llama.cpp" in engines:
            theirs = vals["llama.cpp"]
            for e in ours:
                ok = vals[e] and theirs
                row[f"{e} / llama.cpp"] = row[e] / row["llama.cpp"] if ok else None
                row[f"{e} / llama.cpp, best"] = _best(vals[e], k) / _best(theirs, k) if ok else None
        if any(row[e] is not None for e in engines):
            rows.append(row)
    lines = []
    stream: dict = {"metric": "tg weight stream (GB/s)"}
    share_row: dict = {"metric": "tg weight stream / read bandwidth"}
    for e in ours:
        frac = statistics.median(r["tg_kernel_frac"] for r in results[e])
        share = statistics.median(r["tg_weight_gbs"] / r["read_bw_gbs"] for r in results[e])
        gbs = statistics.median(r["tg_weight_gbs"] for r in results[e])
        lines.append(f"{e} decode: {frac:.0%} of step time inside kernel calls; weights streamed at {gbs:.1f} GB/s "
                     f"= {share:.0%} of the read bandwidth measured in the same child (median of per-run ratios)")
        stream[e], share_row[e] = gbs, share
    busy = [f"{e} run {i}" for e in engines for i, r in enumerate(results[e]) if r["busy"]]
    if busy:
        lines.append(f"BUSY MACHINE: other processes used > {BUSY_CORES} cores, or > {REFAULT_GIB} GiB of file "
                     f"pages were re-read after eviction, during {', '.join(busy)}: their figures are low")
    return rows + ([stream, share_row] if ours else []), lines


def _fmt(v: float | str | None, ratio: bool = False) -> str:
    if v is None or isinstance(v, str):
        return v or "-"
    return f"{v:.2f}x" if ratio else f"{v:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096, help="context of the hybridmoe and llama-cpp-python runs")
    ap.add_argument("--runs", type=int, default=3, help="child processes per engine, engines alternating")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each test inside one child")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    ap.add_argument("--llama-bench", metavar="PATH", help="llama.cpp's llama-bench binary (default: see above)")
    ap.add_argument("--llama-server", metavar="PATH", help="use the llama-bench beside this llama-server")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per child run")
    ap.add_argument("--cache", choices=["warm", "drop", "as-is"], default="warm",
                    help="warm: read the file once before the first child (default); drop: drop and re-read "
                         "it before every child; as-is: leave the page cache")
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
    print(f"model={model}  threads={args.threads}  ctx={args.ctx}  runs={args.runs} (alternating)  reps={args.reps}"
          f"  page cache: {args.cache}", flush=True)
    rec = record.new("vs_llamacpp", {
        "model": os.path.basename(model), "model_gb": round(os.path.getsize(model) / 1e9, 2),
        "threads": args.threads, "ctx": args.ctx, "runs": args.runs, "reps": args.reps, "engines": engines,
        "page_cache": args.cache})
    if llama is not None:
        rec["versions"]["llama.cpp"] = {"driver": llama.driver, "version": llama.version}
    results: dict[str, list[dict]] = {e: [] for e in engines}
    if args.cache == "warm":
        gb, secs = warm_page_cache(model, drop=False)
        print(f"page cache warmed once: {gb:.2f} GB read in {secs:.1f} s", flush=True)
    for run in range(args.runs):
        order = engines if run % 2 == 0 else engines[::-1]
        for engine in order:
            if args.cache == "drop":
                gb, secs = warm_page_cache(model, drop=True)
                print(f"page cache dropped and re-read: {gb:.2f} GB in {secs:.1f} s", flush=True)
            r = run_child(engine, model, args, llama)
            results[engine].append(r)
            rec["runs"].append({"run": run, "engine": engine, **r})
            rates = "  ".join(f"{k} " + "/".join(f"{v:.2f}" for v in r["samples"].get(k, [])) for k in RATE_KEYS)
            cached = r["cached_gib_at_start"]
            print(f"run {run} {engine}: {rates}; file cached at start "
                  f"{'?' if cached is None else f'{cached:.1f}'} GiB, peak anon {r['anon_gib']:.1f} GiB, "
                  f"file rss {r['file_rss_gib']:.1f} GiB, refaulted {r['refaulted_gib']:.2f} GiB, "
                  f"other processes {r['other_cores']:.2f} cores"
                  + (" (BUSY)" if r["busy"] else ""), flush=True)

    rows, lines = summarize(results, engines)
    for line in lines:
        print(line)
    cols = [c for c in rows[0] if c != "metric"]
    print("\n| metric | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for row in rows:
        if row["metric"] in KEYS:
            print(f"| {row['metric']} | " + " | ".join(_fmt(row.get(c), "/" in c) for c in cols) + " |")
    print(f"(pp/tg in tok/s, higher is better; seconds and GiB lower is better; min-max over {args.reps} "
          f"repetitions x {args.runs} runs; first_prefill_s = the first {WARMUP_TOKENS}-token prefill after load, "
          "which pays for first-touch page faults"
          + ("; llama-bench reports no load time" if llama and llama.driver == "llama-bench" else "") + ")")
    rec["rows"] = rows
    rec["machine"]["busy_runs"] = sum(r["busy"] for rs in results.values() for r in rs)
    record.write(rec, args.json)


if __name__ == "__main__":
    main()
