"""`hybridmoe generate -m MODEL -p PROMPT -n N`: one completion, then prompt and decode speed."""

from __future__ import annotations

import argparse
import logging
import sys

from hybridmoe.commands.model_source import add_model_args, model_file
from hybridmoe.settings import (
    ComputeSettings,
    ContextSettings,
    LoadSettings,
    PlacementSettings,
    SamplingDefaults,
    add_compute_args,
    add_context_args,
    add_load_args,
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
    add_load_args(p)
    return p


def _check_tensors(path: str | None) -> None:
    """--check-tensors before the model is built (and before torch is imported): a bad scale or
    value is a GGUFError, printed by the CLI as one line."""
    from hybridmoe.gguf.reader import open_model
    from hybridmoe.quant.check import check_tensors_logged

    if path is None:  # the bundled demo (or a synthetic model), found where LLM finds it
        from hybridmoe.engine.llm import resolve_model_path

        path = resolve_model_path(None)
    with open_model(path) as mf:
        check_tensors_logged(mf, logging.getLogger("hybridmoe.generate"))


def run(args: argparse.Namespace) -> int:
    sampling = SamplingDefaults.from_args(args)
    compute, context = ComputeSettings.from_args(args), ContextSettings.from_args(args)
    placement = PlacementSettings.from_args(args)
    path = model_file(args)
    if LoadSettings.from_args(args).check_tensors:
        _check_tensors(path)
    from hybridmoe.engine.llm import LLM

    llm = LLM(path, compute=compute, placement=placement, context=context, progress=True)
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
