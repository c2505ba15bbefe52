"""Open-time and RSS of our GGUF reader vs gguf.GGUFReader on a gpt-oss-sized file.

Without -m it writes a 20b-shaped file to a temp dir: the full-size tokenizer (201,088 token strings,
446,189 merges, synthesized) and the real tensor table (459 tensors, ~12 GB) as a sparse hole.
Each open runs in a fresh subprocess so the RSS delta is clean. Prints medians of --runs runs.

    OMP_NUM_THREADS=1 nice -n 10 python bench/gguf_open.py [-m MODEL] [--runs 3] [--skip-gguf-py] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import machine
import record

N_TOKENS, N_MERGES = 201_088, 446_189
LAYERS, EXPERTS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 24, 32, 2880, 64, 8, 64


def _byte_alphabet() -> list[str]:
    # the 256 printable stand-ins GPT-2 byte-level BPE uses (facts: printable latin-1 kept, rest
    # shifted to 256+)
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    out, n = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + n))
            n += 1
    return out


def synth_tokenizer(seed: int = 0) -> tuple[list[str], list[str]]:
    rng = np.random.default_rng(seed)
    alpha = np.array(_byte_alphabet())
    lens = rng.integers(2, 12, N_TOKENS)
    codes = rng.integers(0, 256, int(lens.sum()))
    chars = alpha[codes]
    bounds = np.concatenate(([0], np.cumsum(lens)))
    tokens = alpha.tolist() + ["".join(chars[a:b]) + f"{i}" for i, (a, b) in
                               enumerate(zip(bounds[:-1], bounds[1:]))][: N_TOKENS - 256]
    left = rng.integers(0, N_TOKENS, N_MERGES)
    right = rng.integers(0, N_TOKENS, N_MERGES)
    merges = [f"{tokens[a]} {tokens[b]}" for a, b in zip(left.tolist(), right.tolist())]
    return tokens, merges


def write_20b_shaped(path: str) -> None:
    from hybridmoe.gguf.constants import GGMLType as T
    from hybridmoe.gguf.writer import TensorSpec, write_gguf

    tokens, merges = synth_tokenizer()
    meta = {
        "general.architecture": "gpt-oss",
        "gpt-oss.block_count": LAYERS,
        "gpt-oss.expert_count": EXPERTS,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.ones(N_TOKENS, dtype=np.int32),
        "tokenizer.ggml.merges": merges,
    }
    q, k = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    ts = [TensorSpec("token_embd.weight", T.Q8_0, (HIDDEN, N_TOKENS))]
    for i in range(LAYERS):
        b = f"blk.{i}."
        ts += [TensorSpec(b + "attn_norm.weight", T.F32, (HIDDEN,)),
               TensorSpec(b + "attn_q.weight", T.Q8_0, (HIDDEN, q)),
               TensorSpec(b + "attn_q.bias", T.F32, (q,)),
               TensorSpec(b + "attn_k.weight", T.Q8_0, (HIDDEN, k)),
               TensorSpec(b + "attn_k.bias", T.F32, (k,)),
               TensorSpec(b + "attn_v.weight", T.Q8_0, (HIDDEN, k)),
               TensorSpec(b + "attn_v.bias", T.F32, (k,)),
               TensorSpec(b + "attn_output.weight", T.Q8_0, (q, HIDDEN)),
               TensorSpec(b + "attn_output.bias", T.F32, (HIDDEN,)),
               TensorSpec(b + "attn_sinks.weight", T.F32, (HEADS,)),
               TensorSpec(b + "post_attention_norm.weight", T.F32, (HIDDEN,)),
               TensorSpec(b + "ffn_gate_inp.weight", T.F32, (HIDDEN, EXPERTS)),
               TensorSpec(b + "ffn_gate_inp.bias", T.F32, (EXPERTS,))]
        for part in ("gate", "up", "down"):
            ts += [TensorSpec(b + f"ffn_{part}_exps.weight", T.MXFP4, (HIDDEN, HIDDEN, EXPERTS)),
                   TensorSpec(b + f"ffn_{part}_exps.bias", T.F32, (HIDDEN, EXPERTS))]
    ts += [TensorSpec("output_norm.weight", T.F32, (HIDDEN,)),
           TensorSpec("output.weight", T.Q8_0, (HIDDEN, N_TOKENS))]
    write_gguf(path, meta, ts, sparse=True)


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def child(reader: str, path: str) -> None:
    if reader == "hybridmoe":
        from hybridmoe.gguf.reader import open_model as opener
    else:
        import gguf

        opener = gguf.GGUFReader
    rss0 = _rss_kb()
    t0 = time.perf_counter()
    m = opener(path)
    dt = time.perf_counter() - t0
    n = len(m.tensors)
    print(json.dumps({"open_s": dt, "rss_mb": (_rss_kb() - rss0) / 1024, "n_tensors": n}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("-m", "--model", help="GGUF to open (default: write a 20b-shaped sparse file)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip-gguf-py", action="store_true", help="gguf.GGUFReader takes ~30 s/run")
    ap.add_argument("--child", nargs=2, metavar=("READER", "PATH"), help=argparse.SUPPRESS)
    record.add_json_arg(ap)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return 0
    print(machine.describe())
    rec = record.new("gguf_open", {"model": os.path.basename(args.model) if args.model else
                                   "20b-shaped sparse file with the full-size tokenizer", "runs": args.runs})
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            path = os.path.join(tmp, "gpt-oss-20b-shaped.gguf")
            t0 = time.perf_counter()
            write_20b_shaped(path)
            print(f"wrote {path}: {os.path.getsize(path) / 1e9:.2f} GB (sparse, "
                  f"{os.stat(path).st_blocks * 512 / 1e6:.1f} MB on disk) in "
                  f"{time.perf_counter() - t0:.1f} s")
        readers = ["hybridmoe"] + ([] if args.skip_gguf_py else ["gguf.GGUFReader"])
        print(f"\n| reader | open s (median of {args.runs}) | RSS delta MB | tensors |")
        print("|---|---|---|---|")
        for r in readers:
            res = [json.loads(subprocess.run([sys.executable, __file__, "--child", r, path],
                                             check=True, capture_output=True, text=True).stdout)
                   for _ in range(args.runs)]
            print(f"| {r} | {statistics.median(x['open_s'] for x in res):.3f} | "
                  f"{statistics.median(x['rss_mb'] for x in res):.1f} | {res[0]['n_tensors']} |")
            rec["rows"].append({"reader": r, "open_s": statistics.median(x["open_s"] for x in res),
                                "rss_delta_mb": statistics.median(x["rss_mb"] for x in res),
                                "tensors": res[0]["n_tensors"]})
            rec["runs"] += [{"reader": r, **x} for x in res]
    record.write(rec, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
