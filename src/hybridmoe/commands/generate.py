"""`hybridmoe generate -m MODEL -p PROMPT -n N`: one completion, then prompt and decode speed."""

from __future__ import annotations

import argparse
import sys

from hybridmoe.commands.model_source import add_model_args, model_file
from hybridmoe.settings import (
    ComputeSettings,
    ContextSettings,
    PlacementSettings,
    SamplingDefaults,
    add_compute_args,
    add_context_args,
    add_placement_args,
    add_sampling_args,
)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="generate text from a prompt", description=__doc__, allow_abbrev=False)
    add_model_args(p, "GGUF file (default: the bundled demo model)")
    p.add_argument("-p", "--prompt", default="Hello", help="prompt text (special tokens allowed)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at an end token")
    add_sampling_args(p)
    add_compute_args(p)
    add_context_args(p)
    add_placement_args(p)
    return p


def run(args: argparse.Namespace) -> int:
    sampling = SamplingDefaults.from_args(args)
    compute, context = ComputeSettings.from_args(args), ContextSettings.from_args(args)
    placement = PlacementSettings.from_args(args)
    from hybridmoe.engine.llm import LLM

    llm = LLM(model_file(args), compute=compute, placement=placement, context=context, progress=True)
    res = llm.generate(
        args.prompt, max_tokens=sampling.n_predict, temperature=sampling.temperature, top_k=sampling.top_k,
        top_p=sampling.top_p, min_p=sampling.min_p, seed=sampling.request_seed, ignore_eos=args.ignore_eos,
        chain=sampling.samplers,
    )
    print(args.prompt + res.text)
    t = res.timings
    print(
        f"\nload {llm.load_seconds:.2f} s | prompt {t['prompt_n']} tok, {t['prompt_per_second']:.2f} tok/s | "
        f"decode {t['predicted_n']} tok, {t['predicted_per_second']:.2f} tok/s | finish: {res.finish_reason}",
        file=sys.stderr,
    )
    return 0
