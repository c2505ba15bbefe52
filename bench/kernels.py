"""Kernel throughput on 20b shapes (H = I = 2880, 32 experts, top-4): GB/s of weight bytes for a
cold MoE layer at T=1, GFLOP/s at T=8/64/512, the Q8_0 output head at T=1, the other block types
(Q4_0 ... Q6_K, --ext-types) as a cold 2880x4096 dense GEMV at T=1, beside the machine's read
bandwidth measured in the same run (numpy sum over a large array, 1 and 2 threads).

Fast mode (act=kernels.Activations.INT8: int8 activations; the int8 GEMV, and the int8 GEMM on the
tile path) gets its own rows, measured in the same run, and a closing table of speed-ups over fp32
(1 thread: thread-CPU-time rates, which the other processes on a shared core do not distort;
2 threads: wall-time medians). The GEMV-path modes (INT16: two int16 terms; INT8X3: three int8
digits, on ISAs where kernels.digits_active()) get rows for the T=1 cases, same run.

"Cold": each call routes to 4 experts of a fresh group, cycling through 32 experts (423 MB),
so the weights come from RAM, not the 32 MB L3. Medians of --repeats runs. Numbers are noisy on
a shared machine; rerun when it is quiet.

    python bench/kernels.py [--threads 1 2] [--repeats 7] [--isa auto] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import numpy as np
import torch

import hybridmoe.kernels as K
import machine
import record
from hybridmoe.gguf.constants import GGMLType
from hybridmoe.kernels._lib import LIB

# (record key, mode) of the T=1 cases; "default" and "fast" are the keys every record has.
T1_MODES = (("default", K.Activations.FP32), ("int16", K.Activations.INT16), ("int8x3", K.Activations.INT8X3),
            ("fast", K.Activations.INT8))
LABEL = {"default": "", "int16": " INT16", "int8x3": " INT8X3 digits", "fast": " FAST int8"}

H = I = 2880
E, TOPK = 32, 4
MX_ROW = H // 32 * 17
Q8_ROW = H // 32 * 34


def random_mxfp4(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    w = rng.integers(0, 256, size=shape, dtype=np.uint8)
    w[..., ::17] = rng.integers(119, 124, size=w[..., ::17].shape, dtype=np.uint8)  # scales ~1/16
    return w


def ext_matrices(rng: np.random.Generator, t: GGMLType, total_bytes: int = 96 << 20) -> list[np.ndarray]:
    """Copies of one random 2880x4096 matrix of type t (attn_output's shape, whose 4096-wide rows
    take the 256-element types too), enough of them (~96 MB) that a cycle through them runs cold."""
    from hybridmoe.quant.formats import quantize

    w = quantize(rng.standard_normal((H, 4096), dtype=np.float32) * 0.02, t)
    return [w.copy() for _ in range(max(2, total_bytes // w.nbytes))]


def random_q8_0(rng: np.random.Generator, n: int) -> np.ndarray:
    w = rng.integers(-127, 128, size=(n, H // 32, 34), dtype=np.int8).view(np.uint8)
    w[:, :, :2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    return w.reshape(n, Q8_ROW)


LAST_CPU_S: list[float] = [0.0]  # median calling-thread CPU seconds of the last timed() call
LAST_TIMES: list[list[float]] = [[]]  # the wall seconds of every repeat of the last timed() call


def timed(fn, repeats: int) -> tuple[float, float]:
    """(median, best) wall seconds of `repeats` calls after one warm-up call. Also records the
    calling thread's CPU time: with 1 kernel thread all work runs there, so it shows per-core
    speed even when other processes share the core (wall time then mostly measures them)."""
    fn()  # warm-up (page faults, pool start)
    times, cpu = [], []
    for _ in range(repeats):
        c0, t0 = time.thread_time(), time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    LAST_CPU_S[0] = statistics.median(cpu)
    LAST_TIMES[0] = times
    return statistics.median(times), min(times)


def cpu_note(nt: int, amount: float, unit: str) -> str:
    return f"; 1-core CPU-time rate {amount / LAST_CPU_S[0] / 1e9:.1f} {unit}" if nt == 1 else ""


def median_time(fn, repeats: int) -> float:
    return timed(fn, repeats)[0]


def read_bandwidth(buf: np.ndarray, threads: int, repeats: int) -> float:
    """GB/s of np.sum over `buf` split across `threads` Python threads (numpy drops the GIL)."""
    parts = np.array_split(buf, threads)

    def run() -> None:
        ts = [threading.Thread(target=np.sum, args=(p,)) for p in parts]  # numpy drops the GIL
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    return buf.nbytes / median_time(run, repeats) / 1e9


def read_bandwidth_c(buf: np.ndarray, repeats: int) -> float | None:
    """GB/s of the kernel library's own read loop on its thread pool (None without the library)."""
    if not K.available():
        return None
    addr = buf.__array_interface__["data"][0]
    return buf.nbytes / median_time(lambda: LIB.hm_read_probe(addr, buf.nbytes), repeats) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--isa", default="auto")
    ap.add_argument("--bw-gib", type=float, default=2.0, help="size of the read-bandwidth array")
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--ext-types", nargs="*", default=[t.name for t in K.EXT_TYPES],
                    help="the other ggml block types to time as a 2880x4096 dense T=1 GEMV (none: skip)")
    ap.add_argument("--gemv-max-tokens", type=int, default=None,
                    help="override the GEMV/tile crossover (fp32, both formats; fast mode keeps its own, 2)")
    record.add_json_arg(ap)
    args = ap.parse_args()

    torch.set_num_threads(1)
    K.set_isa(args.isa)
    if args.gemv_max_tokens is not None:
        K.set_gemv_max_tokens(args.gemv_max_tokens)
    rng = np.random.default_rng(0)
    gate, up, down = (random_mxfp4(rng, (E, I, MX_ROW)) for _ in range(3))
    experts = K.ExpertTensors(gate, up, down, torch.randn(E, I), torch.randn(E, I), torch.randn(E, H),
                              GGMLType.MXFP4)
    head = random_q8_0(rng, 201088)
    ext_types = [] if args.ext_types in ([], ["none"]) else [GGMLType[n.upper()].name for n in args.ext_types]
    ext_mats = {name: ext_matrices(rng, GGMLType[name]) for name in ext_types}
    bw_buf = np.ones(int(args.bw_gib * 2**30) // 8, dtype=np.float64)
    expert_bytes = 3 * I * MX_ROW

    speedups = []  # (threads, case, {mode key: rate}): GB/s, or GFLOP/s where the case says so
    print(machine.describe())
    print(f"isa={K.isa()}  repeats={args.repeats} (medians)  20b shapes H=I={H}, E={E}, top-{TOPK}"
          f"  INT8X3 digits GEMV {'active' if K.digits_active() else 'inactive (computes fp32)'}")
    rec = record.new("kernels", {"threads": args.threads, "repeats": args.repeats, "isa": K.isa(),
                                 "tokens": args.tokens, "gemv_max_tokens": args.gemv_max_tokens, "bw_gib": args.bw_gib,
                                 "ext_types": ext_types})
    rows = []
    out: dict[tuple[int, str], dict] = {}  # the record's rows by (threads, case)

    def keep(nt: int, case: str, unit: str, mode: str, amount: float, t: float, bw: float | None = None) -> None:
        """One measured value into the record: its row (median rate) and its run (every repeat)."""
        row = out.setdefault((nt, case), {"threads": nt, "isa": K.isa(), "case": case, "unit": unit,
                                          "default": None, "fast": None})
        row[mode] = amount / t / 1e9
        if bw:
            row[f"{mode} share of read bw"] = row[mode] / bw
        rec["runs"].append({"threads": nt, "case": case, "mode": mode, "seconds": LAST_TIMES[0]})
    for nt in args.threads:
        K.set_num_threads(nt)
        bw_np = read_bandwidth(bw_buf, nt, args.repeats)
        keep(nt, "read bandwidth (numpy sum)", "GB/s", "default", bw_buf.nbytes, bw_buf.nbytes / bw_np / 1e9)
        rows.append((nt, "read bandwidth (numpy sum)", f"{bw_np:.1f} GB/s", f"{bw_buf.nbytes / 2**30:.1f} GiB"))
        bw_c = read_bandwidth_c(bw_buf, args.repeats)
        if bw_c is not None:
            keep(nt, "read bandwidth (C loop)", "GB/s", "default", bw_buf.nbytes, bw_buf.nbytes / bw_c / 1e9)
            rows.append((nt, "read bandwidth (C loop, kernel pool)", f"{bw_c:.1f} GB/s", "the % below use the larger"))
        bw = max(bw_np, bw_c or 0.0)

        groups = [np.arange(g * TOPK, (g + 1) * TOPK) for g in range(E // TOPK)]
        state = {"i": 0, "act": K.Activations.FP32}
        x1 = torch.randn(1, H)
        w1 = torch.full((1, TOPK), 0.25)

        def cold_decode() -> None:
            ids = torch.from_numpy(groups[state["i"] % len(groups)].astype(np.int32))[None]
            state["i"] += 1
            K.moe_forward(x1, ids, w1, experts, act=state["act"])

        def rate(amount: float, t: float) -> float:  # the speed-up table's rate: CPU time at 1 thread
            return amount / (LAST_CPU_S[0] if nt == 1 else t) / 1e9

        moe_rates = {}
        for key, act in T1_MODES:
            state["act"] = act
            t, best = timed(cold_decode, args.repeats * 4)
            keep(nt, "MoE T=1 cold, 4 experts", "GB/s", key, TOPK * expert_bytes, t, bw)
            moe_rates[key] = rate(TOPK * expert_bytes, t)
            gbs = TOPK * expert_bytes / t / 1e9
            rows.append((nt, "MoE T=1 cold, 4 experts" + LABEL[key], f"{gbs:.1f} GB/s",
                         f"{t * 1e3:.2f} ms, {gbs / bw:.0%} of read bw; best {TOPK * expert_bytes / best / 1e9:.1f} GB/s"
                         + cpu_note(nt, TOPK * expert_bytes, "GB/s")))
        speedups.append((nt, "MoE T=1 cold", moe_rates))

        for T in args.tokens:
            x = torch.randn(T, H)
            ids = torch.stack([torch.randperm(E)[:TOPK] for _ in range(T)]).to(torch.int32)
            wts = torch.softmax(torch.randn(T, TOPK), -1)
            flops = T * TOPK * 2 * (2 * I * H + H * I)
            rates = {}
            for fast in (False, True):  # fast: int8 GEMV (<= 2 tokens per expert) or int8 GEMM
                act = K.Activations.for_fast_math(fast)
                t, best = timed(lambda: K.moe_forward(x, ids, wts, experts, act=act), max(3, args.repeats // 2))
                keep(nt, f"MoE T={T}", "GFLOP/s", "fast" if fast else "default", flops, t)
                rates["fast" if fast else "default"] = flops / (LAST_CPU_S[0] if nt == 1 else t) / 1e9
                rows.append((nt, f"MoE T={T}" + (" FAST int8" if fast else ""), f"{flops / t / 1e9:.1f} GFLOP/s",
                             f"{t * 1e3:.1f} ms; best {flops / best / 1e9:.1f} GFLOP/s" + cpu_note(nt, flops, "GFLOP/s")))
            speedups.append((nt, f"MoE T={T} (GFLOP/s)", rates))

        xh = torch.randn(1, H)
        head_rates = {}
        for key, act in T1_MODES:
            t, best = timed(lambda: K.linear_q8_0(xh, head, act=act), args.repeats)
            keep(nt, "Q8_0 head 201088x2880 T=1", "GB/s", key, head.nbytes, t, bw)
            head_rates[key] = rate(head.nbytes, t)
            rows.append((nt, "Q8_0 head 201088x2880 T=1" + LABEL[key],
                         f"{head.nbytes / t / 1e9:.1f} GB/s",
                         f"{t * 1e3:.1f} ms, {head.nbytes / t / 1e9 / bw:.0%} of read bw; best {head.nbytes / best / 1e9:.1f}"
                         + cpu_note(nt, head.nbytes, "GB/s")))
        speedups.append((nt, "Q8_0 head T=1", head_rates))
        x4 = torch.randn(1, 4096)
        for name in ext_types:
            t = GGMLType[name]
            mats, where = ext_mats[name], {"i": 0}

            def ext_gemv() -> None:
                where["i"] += 1
                K.linear_quantized(x4, mats[where["i"] % len(mats)], t)

            nbytes = mats[0].nbytes
            tm, best = timed(ext_gemv, args.repeats * 4)
            case = f"{name} 2880x4096 T=1 cold"
            keep(nt, case, "GB/s", "default", nbytes, tm, bw)
            rows.append((nt, case, f"{nbytes / tm / 1e9:.1f} GB/s",
                         f"{tm * 1e3:.2f} ms, {nbytes / tm / 1e9 / bw:.0%} of read bw; best {nbytes / best / 1e9:.1f}"
                         + cpu_note(nt, nbytes, "GB/s")))
        xd = torch.randn(512, H)
        wd = head[:4096]  # attention q projection shape: 4096 x 2880 Q8_0
        flops = 2 * 512 * 4096 * H
        dense_rates = {}
        for fast in (False, True):  # fast: the int8 GEMM (maddubs on |w| and sign(x, w))
            act = K.Activations.for_fast_math(fast)
            t, best = timed(lambda: K.linear_q8_0(xd, wd, act=act), max(3, args.repeats // 2))
            keep(nt, "Q8_0 4096x2880 T=512", "GFLOP/s", "fast" if fast else "default", flops, t)
            dense_rates["fast" if fast else "default"] = rate(flops, t)
            rows.append((nt, "Q8_0 4096x2880 T=512" + (" FAST int8" if fast else ""), f"{flops / t / 1e9:.1f} GFLOP/s",
                         f"{t * 1e3:.1f} ms; best {flops / best / 1e9:.1f} GFLOP/s" + cpu_note(nt, flops, "GFLOP/s")))
        speedups.append((nt, "Q8_0 4096x2880 T=512 (GFLOP/s)", dense_rates))

    print(f"| threads | case | rate | notes |\n|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")
    print("\nother modes vs fp32 (default), same run; 1 thread: CPU-time rates, 2+: wall medians")
    keys = [k for k, _ in T1_MODES]
    print("| threads | case | " + " | ".join(f"{k} rate" for k in keys) + " | "
          + " | ".join(f"{k} / default" for k in keys[1:]) + " |\n|---|---|" + "---|" * (2 * len(keys) - 1))
    for nt, case, r in speedups:
        cells = [f"{r[k]:.1f}" if k in r else "" for k in keys]
        cells += [f"{r[k] / r['default']:.2f}x" if k in r else "" for k in keys[1:]]
        print(f"| {nt} | {case} | " + " | ".join(cells) + " |")
    print(f"load average at the end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    rec["rows"] = list(out.values())
    record.write(rec, args.json)


if __name__ == "__main__":
    main()
