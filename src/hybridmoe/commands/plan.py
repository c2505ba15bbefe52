"""`hybridmoe plan`: print where every tensor goes and what each device needs, before loading.

Takes the same placement flags as `hybridmoe serve` (llama-server's names) and the same defaults
for -c, --parallel and -ub, so a plain `plan` predicts a plain `serve`. Reads only the GGUF
header; runs on a machine without a GPU (the CUDA device is then hypothetical, sized by
--vram-budget). torch is imported only to query free VRAM for --fit without --vram-budget.
"""

from __future__ import annotations

import argparse
import json
import sys

from hybridmoe.placement.memory import GIB, available_ram_bytes
from hybridmoe.placement.plan import PlacementOptions, check_fits, make_plan
from hybridmoe.placement.report import format_plan
from hybridmoe.placement.rules import PlacementError


def _ngl(value: str) -> int | None:
    if value.lower() in ("all", "auto", "-1"):
        return None
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a layer count or 'all', got {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 or 'all', got {n}")
    return n


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="print the tensor placement and memory plan",
                       description=__doc__, allow_abbrev=False)
    a = p.add_argument
    a("-m", "--model", required=True, help="GGUF file (first part of a split model)")
    a("-ngl", "--n-gpu-layers", "--gpu-layers", type=_ngl, default=None,
      help="layers on the GPU, counted from the last; the output head counts as one (default all)")
    a("--cpu-moe", "-cmoe", action="store_true", help="keep every expert tensor on the CPU")
    a("--n-cpu-moe", "-ncmoe", type=int, default=0, help="experts of layers 0..N-1 on the CPU")
    a("-ot", "--override-tensor", action="append", default=[],
      help="REGEX=DEVICE[,...] (repeatable; first match wins; beats --cpu-moe/--n-cpu-moe)")
    a("-c", "--ctx-size", type=int, default=0,
      help="total context, split across slots (0 = the model's)")
    a("-np", "--parallel", type=int, default=4, help="slots (concurrent sequences)")
    a("-ub", "--ubatch-size", type=int, default=512, help="tokens per forward step")
    a("--kv-bytes", type=float, default=2.0, help="bytes per cached K/V value (2 = f16)")
    a("--upload-slots", type=int, default=1,
      help="GPU buffers of one layer's CPU experts for prompt batches (0 = none)")
    a("--gpu-dense-dtype", default="auto", choices=["auto", "stored", "bf16", "f16", "f32"],
      help="quantized non-expert weights on the GPU: kept as stored, or converted at load")
    a("--gpu-device", default="cuda:0", help="the GPU device (cuda:N, CUDA0, or cpu for CPU-only)")
    a("--vram-budget", type=float, default=None, help="GiB the plan may use on the GPU")
    a("--fit", action="store_true", help="choose the most expert layers on the GPU that fit")
    a("--json", action="store_true", help="print the plan as JSON")
    return p


def options_from_args(args: argparse.Namespace) -> PlacementOptions:
    return PlacementOptions(
        n_gpu_layers=args.n_gpu_layers, cpu_moe=args.cpu_moe, n_cpu_moe=args.n_cpu_moe,
        override_tensor=list(args.override_tensor), gpu_device=args.gpu_device,
        ctx_size=args.ctx_size, n_parallel=args.parallel, batch_size=args.ubatch_size,
        kv_dtype_bytes=args.kv_bytes, vram_budget=args.vram_budget, fit=args.fit,
        upload_slots=args.upload_slots, gpu_dense_dtype=args.gpu_dense_dtype)


def run(args: argparse.Namespace) -> int:
    from hybridmoe.gguf.reader import GGUFError, open_model
    from hybridmoe.models.gpt_oss_config import GptOssConfig

    try:
        mf = open_model(args.model)
        try:
            cfg = GptOssConfig.from_metadata(mf.metadata, mf.path)
            plan = make_plan(cfg, mf.tensors, options_from_args(args))
        finally:
            mf.close()
    except (GGUFError, PlacementError, OSError) as e:
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
    name = mf.metadata.get("general.name", args.model)
    print(f"{name}: {cfg.n_layers} layers, {cfg.n_experts} experts (top-{cfg.n_experts_used})")
    print(format_plan(plan, ram))
    if args.vram_budget is not None:
        try:
            check_fits(plan, vram_budget=int(args.vram_budget * GIB))
            print(f"VRAM budget {args.vram_budget:g} GiB: fits")
        except PlacementError as e:
            print(str(e))
            return 1
    return 0
