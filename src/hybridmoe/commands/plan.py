"""`hybridmoe plan`: print where every tensor goes and what each device needs, before loading.

Takes the same placement and context flags as `hybridmoe serve` (one flag table,
hybridmoe.settings), so a plain `plan` predicts a plain `serve`. Reads only the GGUF
header; runs on a machine without a GPU (the CUDA device is then hypothetical, sized by
--vram-budget). torch is imported only to query free VRAM for --fit without --vram-budget.
"""

from __future__ import annotations

import argparse
import json
import sys

from hybridmoe.commands.model_source import add_model_args, model_file
from hybridmoe.gguf.residency import available_ram_bytes
from hybridmoe.placement.fit import check_fits, make_plan
from hybridmoe.placement.memory import GIB
from hybridmoe.placement.plan import PlacementOptions
from hybridmoe.placement.report import format_plan
from hybridmoe.placement.rules import PlacementError
from hybridmoe.settings import (
    ContextSettings,
    ParallelSettings,
    PlacementSettings,
    SettingsError,
    add_context_args,
    add_parallel_args,
    add_placement_args,
)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="print the tensor placement and memory plan",
                       description=__doc__, allow_abbrev=False)
    add_model_args(p, "GGUF file (first part of a split model); this or -hf is required")
    add_placement_args(p)
    add_context_args(p)
    add_parallel_args(p)
    p.add_argument("--kv-bytes", type=float, default=None,
                   help="bytes per cached K/V value on the GPU (4 = f32, 2 = f16; default: what serve "
                        "would pick: f32 when it fits the VRAM budget, else f16)")
    p.add_argument("--fast-math", action="store_true",
                   help="plan serve --fast-math's GPU numerics (bf16 dense weights, f16 KV cache)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def options_from_args(args: argparse.Namespace) -> PlacementOptions:
    """What `serve` with the same flags would plan (its context, sequences and step size)."""
    context = ContextSettings.from_args(args)
    return PlacementOptions(
        PlacementSettings.from_args(args), ctx_size=context.ctx_size,
        n_parallel=ParallelSettings.from_args(args).n_parallel, batch_size=context.step_tokens,
        kv_dtype_bytes=args.kv_bytes if args.kv_bytes is not None else context.kv_bytes, fast_math=args.fast_math)


def run(args: argparse.Namespace) -> int:
    from hybridmoe.gguf.errors import GGUFError
    from hybridmoe.gguf.reader import open_model
    from hybridmoe.gpt_oss_config import GptOssConfig

    try:
        options = options_from_args(args)
        path = model_file(args)
        if path is None:
            raise ValueError("a model is required: -m FILE or -hf ORG/NAME")
        mf = open_model(path)
        try:
            cfg = GptOssConfig.from_metadata(mf.metadata, mf.path)
            plan = make_plan(cfg, mf.tensors, options)
        finally:
            mf.close()
    except (GGUFError, PlacementError, SettingsError, OSError) as e:
        print(f"hybridmoe plan: error: {e}", file=sys.stderr)
        return 2
    ram = available_ram_bytes()
    if args.json:
        out = plan.to_json()
        out["ram"]["available_bytes"] = ram
        try:
            json.dump(out, sys.stdout, indent=1)
            print()
        except BrokenPipeError:  # `hybridmoe plan --json | head` is fine
            sys.stderr.close()
        return 0
    name = mf.metadata.get("general.name", mf.path)
    print(f"{name}: {cfg.n_layers} layers, {cfg.n_experts} experts (top-{cfg.n_experts_used})")
    print(format_plan(plan, ram))
    budget = options.placement.vram_budget
    if budget is not None:
        try:
            check_fits(plan, vram_budget=int(budget * GIB))
            print(f"VRAM budget {budget:g} GiB: fits")
        except PlacementError as e:
            print(str(e))
            return 1
    return 0
