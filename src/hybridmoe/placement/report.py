"""Human-readable rendering of a Plan (used by `hybridmoe plan` and by whoever loads a model)."""

from __future__ import annotations

from hybridmoe.placement.memory import GIB
from hybridmoe.placement.plan import Plan
from hybridmoe.placement.rules import CPU, KINDS


def _gib(n: int) -> str:
    return f"{n / GIB:8.3f}"


def _layer_ranges(layers: list[int]) -> str:
    """[0,1,2,5] -> '0-2,5'."""
    if not layers:
        return "none"
    out, start = [], layers[0]
    for a, b in zip(layers, layers[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)


def format_layers(plan: Plan) -> list[str]:
    """Runs of layers with the same attention device and expert backend, one row per run."""
    rows = [f"{'layers':<10}{'attention':<12}experts"]
    runs: list[tuple[list[int], str, str]] = []
    for i, (attn, kind) in enumerate(zip(plan.layer_devices, plan.expert_backends)):
        if runs and runs[-1][1:] == (attn, kind):
            runs[-1][0].append(i)
        else:
            runs.append(([i], attn, kind))
    rows += [f"{_layer_ranges(ls):<10}{attn:<12}{kind}" for ls, attn, kind in runs]
    rows += ["experts: cpu = C kernels on the mmap; staged = those kernels, activations copied from the GPU;",
             "  stream = staged, but big batches upload the experts they hit to the GPU; gpu = resident there"]
    return rows


def format_plan(plan: Plan, ram_available: int | None = None) -> str:
    """A table per device (weights by kind, KV, compute, total; GiB) and the RAM side."""
    o = plan.options
    devs = list(plan.devices)
    w = 12
    lines = [
        f"context {plan.ctx_size} tokens ({o.n_parallel} slot(s) of {plan.ctx_per_slot}), "
        f"micro-batch {o.batch_size}, "
        f"KV {o.kv_dtype_bytes:g} B/value, expert upload buffers {o.placement.upload_buffers}",
        "",
        f"{'GiB':<24}" + "".join(f"{d:>{w}}" for d in devs),
    ]

    def row(label: str, values: list[int]) -> None:
        lines.append(f"{label:<24}" + "".join(f"{_gib(v):>{w}}" for v in values))

    for kind in KINDS:
        vals = [plan.devices[d].weights_by_kind.get(kind, 0) for d in devs]
        if any(vals):
            row(f"  weights: {kind}", vals)
    row("weights", [plan.devices[d].weights_bytes for d in devs])
    row("KV cache", [plan.devices[d].kv_bytes for d in devs])
    compute = [plan.devices[d].compute.as_dict() for d in devs]
    for part in compute[0]:
        vals = [c[part] for c in compute]
        if any(vals):
            row(f"  compute: {part}", vals)
    row("compute", [plan.devices[d].compute_bytes for d in devs])
    row("TOTAL", [plan.devices[d].total_bytes for d in devs])
    lines.append(f"{'TOTAL (GB, 1e9 B)':<24}"
                 + "".join(f"{plan.devices[d].total_bytes / 1e9:>{w}.2f}" for d in devs))

    L = len(plan.expert_devices)
    gpu_exp = [i for i, d in enumerate(plan.expert_devices) if d != CPU]
    cpu_layers = [i for i, d in enumerate(plan.layer_devices) if d == CPU]
    head = next((t.device for t in plan.tensors if t.name == "output.weight"), "?")
    lines += [
        "",
        f"expert layers on GPU: {len(gpu_exp)}/{L} ({_layer_ranges(gpu_exp)}); "
        f"expert layers on CPU: {L - len(gpu_exp)}/{L}; whole layers on CPU: "
        f"{_layer_ranges(cpu_layers)}; output head on {head}",
        "",
        *format_layers(plan),
        "",
    ]
    r = plan.ram
    lines.append(
        f"RAM side: mmap'd experts {r.mmap_expert_bytes / GIB:.3f} GiB (page cache, read every "
        f"token) + other mmap'd tensors {r.mmap_other_bytes / GIB:.3f} GiB + KV "
        f"{r.kv_bytes / GIB:.3f} GiB + compute {r.compute_bytes / GIB:.3f} GiB = "
        f"{r.total_bytes / GIB:.3f} GiB")
    if ram_available is not None:
        verdict = ("fits" if r.total_bytes <= ram_available
                   else "DOES NOT FIT (experts would be re-read from disk)")
        lines.append(f"RAM available {ram_available / GIB:.3f} GiB: {verdict}")
    lines += plan.notes
    return "\n".join(lines)
