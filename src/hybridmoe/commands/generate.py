"""`hybridmoe generate -m MODEL -p PROMPT -n N`: one completion, then prompt and decode speed."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt")
    p.add_argument("-m", "--model", default=None, help="GGUF file (default: the bundled demo model)")
    p.add_argument("-p", "--prompt", default="Hello", help="prompt text (special tokens allowed)")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate")
    p.add_argument("--temp", type=float, default=0.8, help="temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size (0 = model's)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--fast-math", action="store_true",
                   help="int8 activations (decode, and MXFP4 experts in prompts): faster, ~5e-3 "
                        "relative error per matmul (default: exact fp32)")
    p.add_argument("--cpu-moe", action="store_true", help="keep all expert tensors on the CPU")
    p.add_argument("--n-cpu-moe", type=int, default=0, help="experts of the first N layers on the CPU")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=None)
    p.add_argument("-ot", "--override-tensor", action="append", default=None, help="REGEX=DEVICE")


def run(args: argparse.Namespace) -> int:
    from hybridmoe.engine.llm import LLM

    placement = {
        "cpu_moe": args.cpu_moe,
        "n_cpu_moe": args.n_cpu_moe,
        "n_gpu_layers": args.n_gpu_layers,
        "override_tensor": args.override_tensor,
    }
    llm = LLM(args.model, threads=args.threads, ctx_size=args.ctx_size, progress=True,
              fast_math=args.fast_math, **placement)
    res = llm.generate(
        args.prompt, max_tokens=args.n_predict, temperature=args.temp, top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, seed=args.seed, ignore_eos=args.ignore_eos,
    )
    print(args.prompt + res.text)
    t = res.timings
    print(
        f"\nload {llm.load_seconds:.2f} s | prompt {t['prompt_n']} tok, {t['prompt_per_second']:.2f} tok/s | "
        f"decode {t['predicted_n']} tok, {t['predicted_per_second']:.2f} tok/s | finish: {res.finish_reason}",
        file=sys.stderr,
    )
    return 0
