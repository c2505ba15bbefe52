"""make_plan: the placement plan whose numerics and expert layers fit the VRAM budget.

Numerics set to auto (dense GPU weights' dtype, KV bytes) take the most precise choice that fits;
`--fit` then moves the most expert layers to the GPU that still fit (fit_plan). check_fits says
whether a plan exceeds the VRAM or RAM it will get, naming the numbers.
"""

from __future__ import annotations

import dataclasses

from hybridmoe.gpt_oss_config import GptOssConfig
from hybridmoe.placement.memory import GIB, VRAM_MARGIN_BYTES, cuda_free_bytes, gib
from hybridmoe.placement.plan import Plan, PlacementOptions, TensorLike, place
from hybridmoe.placement.rules import CPU, PlacementError, normalize_device
from hybridmoe.settings import PlacementSettings


def _plan_for(cfg: GptOssConfig, tensors: dict[str, TensorLike], opts: PlacementOptions) -> Plan:
    if opts.placement.gpu_dense_dtype == "auto" or opts.kv_dtype_bytes is None:
        return _auto_precision(cfg, tensors, opts)
    return place(cfg, tensors, opts)


def _kv_name(kv_bytes: float) -> str:
    return {4: "f32", 2: "f16"}.get(kv_bytes, f"{kv_bytes:g} B/value")


def _precision_candidates(opts: PlacementOptions) -> list[PlacementOptions]:
    """`opts` with "auto" dense dtype / KV bytes resolved, most precise first: float32 dense and
    cache (bf16 / f16 with --fast-math), then dense weights kept as stored (same values, decoded
    per call), then an f16 cache. Explicit choices stay as given."""
    dense = ([("bf16" if opts.fast_math else "f32"), "stored"] if opts.placement.gpu_dense_dtype == "auto"
             else [opts.placement.gpu_dense_dtype])
    kv = [2.0 if opts.fast_math else 4.0, 2.0] if opts.kv_dtype_bytes is None else [opts.kv_dtype_bytes]
    return [dataclasses.replace(opts, kv_dtype_bytes=k,
                                placement=dataclasses.replace(opts.placement, gpu_dense_dtype=d))
            for d, k in dict.fromkeys((d, k) for k in kv for d in dense)]


def _precision_notes(asked: PlacementOptions, chosen: PlacementOptions, why: str) -> list[str]:
    notes = []
    if asked.placement.gpu_dense_dtype == "auto":
        notes.append(f"dense GPU weights: {chosen.placement.gpu_dense_dtype} ({why}; --gpu-dense-dtype sets it)")
    if asked.kv_dtype_bytes is None:
        kv = _kv_name(chosen.kv_dtype_bytes)
        extra = ("; f16 rounds each cached value to ~5e-4 relative (--fast-math numerics)"
                 if kv == "f16" and not asked.fast_math else "")
        notes.append(f"KV cache on the GPU: {kv} ({why}){extra}")
    return notes


def _why(candidates: list[PlacementOptions], chosen: PlacementOptions, budget: int | None) -> str:
    if budget is None:
        return "no VRAM budget known"
    if chosen == candidates[0]:
        return f"fits the {gib(budget)} budget"
    first = candidates[0]
    return (f"{first.placement.gpu_dense_dtype} dense weights with an {_kv_name(first.kv_dtype_bytes)} cache "
            f"would exceed the {gib(budget)} budget")


def _auto_precision(cfg: GptOssConfig, tensors: dict[str, TensorLike], opts: PlacementOptions) -> Plan:
    """Resolve "auto" dense dtype and KV bytes: the first of _precision_candidates that fits the
    VRAM budget (an 8 GB card at -c 0 needs the last); without a known budget, the smallest."""
    gpu = normalize_device(opts.placement.gpu_device)
    if gpu == CPU:  # a CPU-only plan: the cache is float32 (what the C decode kernel reads)
        return _plan_for(cfg, tensors, dataclasses.replace(
            opts, kv_dtype_bytes=opts.kv_dtype_bytes or 4.0,
            placement=dataclasses.replace(opts.placement, gpu_dense_dtype=(
                "f32" if opts.placement.gpu_dense_dtype == "auto" else opts.placement.gpu_dense_dtype))))
    budget = resolve_vram_budget(opts.placement)
    candidates = _precision_candidates(opts)
    plans = [_plan_for(cfg, tensors, c) for c in candidates]
    chosen = plans[-1] if budget is None else next(
        (p for p in plans if p.devices[gpu].total_bytes <= budget), plans[-1])
    chosen.notes.extend(_precision_notes(opts, chosen.options, _why(candidates, chosen.options, budget)))
    return chosen


def resolve_vram_budget(p: PlacementSettings) -> int | None:
    """Budget in bytes: --vram-budget, else the device's free memory minus a margin (CUDA only)."""
    if p.vram_budget is not None:
        return int(p.vram_budget * GIB)
    gpu = normalize_device(p.gpu_device)
    if gpu == CPU:
        return None
    free = cuda_free_bytes(gpu)
    return None if free is None else max(free - VRAM_MARGIN_BYTES, 0)


def make_plan(config: GptOssConfig, tensors: dict[str, TensorLike],
              options: PlacementOptions | None = None) -> Plan:
    """Decide every tensor's device and the bytes each device needs.

    Pure apart from `fit` without a `vram_budget`, which asks CUDA for its free memory.
    Raises PlacementError on a bad option, regex or device, or when `fit` cannot fit.
    """
    opts = options or PlacementOptions()
    opts.validate()
    if not tensors:
        raise PlacementError("empty tensor index: nothing to place")
    if not opts.placement.fit:
        return _plan_for(config, tensors, opts)
    if opts.placement.cpu_moe or opts.placement.n_cpu_moe:
        raise PlacementError("--fit chooses the CPU expert layers itself: drop --cpu-moe/--n-cpu-moe")
    budget = resolve_vram_budget(opts.placement)
    if budget is None:
        raise PlacementError(
            f"--fit needs a VRAM budget: no CUDA device {opts.placement.gpu_device!r} to measure here, "
            "pass --vram-budget GiB")
    return fit_plan(config, tensors, opts, budget)


def fit_plan(cfg: GptOssConfig, tensors: dict[str, TensorLike], opts: PlacementOptions,
             budget_bytes: int) -> Plan:
    """The plan with the most expert layers on the GPU whose GPU total fits `budget_bytes`, at
    the most precise numerics that fit with every expert on the CPU (precision before speed).

    Layers move in llama.cpp's --n-cpu-moe order (the CPU keeps the lowest indices). GPU bytes
    grow with each layer moved, except that the upload buffers vanish once no expert layer is
    left on the CPU, so "all on GPU" is tried first, then a bisection over the rest.
    """
    L = cfg.n_layers
    gpu = normalize_device(opts.placement.gpu_device)
    if gpu == CPU:
        raise PlacementError("--fit needs a GPU device, but gpu_device is 'cpu'")

    def plan_with(o: PlacementOptions, n_gpu_layers_exp: int) -> Plan:
        p = dataclasses.replace(o.placement, fit=False, cpu_moe=False, n_cpu_moe=L - n_gpu_layers_exp)
        return _plan_for(cfg, tensors, dataclasses.replace(o, placement=p))

    def gpu_total(p: Plan) -> int:
        return p.devices[gpu].total_bytes

    candidates = _precision_candidates(opts)
    lo_plan = None
    for numerics in candidates:
        lo_plan = plan_with(numerics, 0)
        if gpu_total(lo_plan) <= budget_bytes:
            break
    else:
        u = lo_plan.devices[gpu]
        raise PlacementError(
            f"--fit: even with every expert on the CPU, {gpu} needs {gib(u.total_bytes)} "
            f"(weights {gib(u.weights_bytes)}, KV {gib(u.kv_bytes)}, compute "
            f"{gib(u.compute_bytes)}) but the budget is {gib(budget_bytes)}; lower -c, "
            "--parallel or -ngl")
    best = plan_with(numerics, L)
    if gpu_total(best) > budget_bytes:
        lo, hi = 0, L - 1  # invariant: plan_with(lo) fits; answer in [lo, hi]
        best = lo_plan
        while lo < hi:
            mid = (lo + hi + 1) // 2
            p = plan_with(numerics, mid)
            if gpu_total(p) <= budget_bytes:
                lo, best = mid, p
            else:
                hi = mid - 1
    g = sum(d != CPU for d in best.expert_devices)
    best.options = dataclasses.replace(numerics, placement=dataclasses.replace(numerics.placement, n_cpu_moe=L - g))
    note = (f"fit: budget {gib(budget_bytes)} on {gpu}; {g} of {L} expert layers on the GPU "
            f"(--n-cpu-moe {L - g}) need {gib(gpu_total(best))}")
    if g < L:
        nxt = gpu_total(plan_with(numerics, g + 1))
        note += f"; {g + 1} would need {gib(nxt)} (over by {gib(nxt - budget_bytes)})"
    best.notes = [note] + best.notes + _precision_notes(opts, numerics, _why(candidates, numerics, budget_bytes))
    return best


def check_fits(plan: Plan, vram_budget: int | None = None, ram_available: int | None = None) -> None:
    """Raise PlacementError naming the numbers if the plan exceeds a budget (both in BYTES).

    vram_budget applies to every non-CPU device; ram_available to the CPU side (mmap'd weights,
    which must stay in the page cache, plus CPU KV and compute buffers). None skips a check.
    """
    problems = []
    if vram_budget is not None:
        for d, u in plan.devices.items():
            if d != CPU and u.total_bytes > vram_budget:
                problems.append(
                    f"{d} needs {gib(u.total_bytes)} (weights {gib(u.weights_bytes)}, KV "
                    f"{gib(u.kv_bytes)}, compute {gib(u.compute_bytes)}) > VRAM budget "
                    f"{gib(vram_budget)}: move expert layers to the CPU (--n-cpu-moe, --fit) "
                    "or lower -c/--parallel")
    if ram_available is not None and plan.ram.total_bytes > ram_available:
        r = plan.ram
        problems.append(
            f"RAM: needs {gib(r.total_bytes)} (mmap'd experts {gib(r.mmap_expert_bytes)}, other "
            f"tensors {gib(r.mmap_other_bytes)}, KV {gib(r.kv_bytes)}, compute "
            f"{gib(r.compute_bytes)}) > available {gib(ram_available)}: experts would be re-read "
            "from disk on every token")
    if problems:
        raise PlacementError("plan does not fit: " + "; ".join(problems))
