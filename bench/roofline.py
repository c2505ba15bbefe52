"""Decode roofline of a GGUF on this machine: the weight bytes one decode step must read, and the
tokens/s the same-run read bandwidth allows, for 1..N concurrent streams.

    python bench/roofline.py -m gpt-oss-20b-synth.gguf [--streams 1,2,4] [--threads 2] [--json out.json]

A step of S streams reads every dense tensor once (attention, router, norms, output head), one
embedding row per stream, and each expert that at least one stream's token picked. With routing
spread uniformly (the synthetic files; real models are not far off across unrelated chats), a
layer of E experts, top-k, touches E (1 - (1 - k/E)^S) distinct experts on average. The KV cache
is left out (a few MB at tg64's context). The ceiling is bytes / bandwidth: no engine can beat it,
so it bounds what a decode target can ask of a given machine.
"""

from __future__ import annotations

import argparse
import os

import machine
import record


def distinct_experts(n_experts: int, top_k: int, streams: int) -> float:
    """Expected number of experts a layer reads when `streams` tokens each pick top_k of n_experts
    uniformly at random (each expert is missed by one token with probability 1 - k/E)."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** streams)


def step_bytes(tensors: dict, n_experts: int, top_k: int, n_layers: int, vocab: int, streams: int) -> dict:
    """Bytes one decode step of `streams` tokens reads, split into dense, embedding and experts."""
    dense = embed = experts_all = 0
    for name, info in tensors.items():
        if "_exps." in name:
            experts_all += info.nbytes
        elif name.startswith("token_embd."):
            embed += info.nbytes
        else:
            dense += info.nbytes
    per_expert_layer = experts_all / (n_experts * n_layers)
    hit = distinct_experts(n_experts, top_k, streams)
    expert = hit * per_expert_layer * n_layers
    rows = streams * embed / vocab
    return {"dense": dense, "embedding_rows": rows, "experts": expert, "experts_per_layer": hit,
            "total": dense + rows + expert}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--streams", default="1,2,4", help="comma-separated stream counts")
    ap.add_argument("-t", "--threads", type=int, default=2, help="threads of the read-bandwidth loop")
    ap.add_argument("--bw-gib", type=float, default=2.0, help="size of the read-bandwidth array")
    ap.add_argument("--repeats", type=int, default=7)
    record.add_json_arg(ap)
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]

    from hybridmoe.gguf.reader import open_model
    from hybridmoe.gpt_oss_config import GptOssConfig

    mf = open_model(args.model)
    cfg = GptOssConfig.from_metadata(mf.metadata, args.model)
    print(machine.describe())
    bw, how = machine.read_bandwidth(args.threads, args.bw_gib, args.repeats)
    print(f"model {os.path.basename(args.model)}: {cfg.n_layers} layers, {cfg.n_experts} experts top-"
          f"{cfg.n_experts_used}; read bandwidth {bw:.1f} GB/s ({how}, {args.threads} threads, median of "
          f"{args.repeats})")
    rec = record.new("roofline", {"model": os.path.basename(args.model), "threads": args.threads,
                                  "streams": streams, "bw_gib": args.bw_gib, "repeats": args.repeats})
    print(f"{'streams':>8} {'experts/layer':>14} {'GB/step':>8} {'dense GB':>9} {'expert GB':>10}"
          f" {'ceiling tok/s':>14} {'per stream':>11} {'vs 1 stream':>12}")
    def shape_bytes(s: int) -> dict:
        return step_bytes(mf.tensors, cfg.n_experts, cfg.n_experts_used, cfg.n_layers, cfg.vocab_size, s)

    one = bw * 1e9 / shape_bytes(1)["total"]
    for s in streams:
        b = shape_bytes(s)
        ceiling = s * bw * 1e9 / b["total"]
        print(f"{s:>8} {b['experts_per_layer']:>14.2f} {b['total'] / 1e9:>8.3f} {b['dense'] / 1e9:>9.3f}"
              f" {b['experts'] / 1e9:>10.3f} {ceiling:>14.2f} {ceiling / s:>11.2f} {ceiling / one:>11.2f}x")
        rec["rows"].append({"streams": s, "experts_per_layer": round(b["experts_per_layer"], 2),
                            "GB_per_step": round(b["total"] / 1e9, 3), "read_GBps": round(bw, 1),
                            "ceiling_tok_s": round(ceiling, 2), "vs_1_stream": round(ceiling / one, 2)})
    record.write(rec, args.json)


if __name__ == "__main__":
    main()
