"""Placement settings: which tensors go to the GPU, with llama-server's flag names and meanings
(`-ngl`, `--cpu-moe`, `--n-cpu-moe`, `-ot`, `--fit`); see docs/placement.md."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from hybridmoe.settings.values import on_off, require

# How quantized non-expert weights sit on a GPU: converted at load when the budget allows (auto),
# kept as stored, or converted to a fixed dtype.
GPU_DENSE_DTYPES = ("auto", "stored", "bf16", "f16", "f32")

GpuLayers = int | Literal["all", "auto"]


def gpu_layers(value: str) -> GpuLayers:
    """`-ngl` as llama-server spells it: a layer count, `all` (also -1) or `auto` (fit to VRAM)."""
    v = value.strip().lower()
    if v in ("all", "-1"):
        return "all"
    if v == "auto":
        return "auto"
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a layer count, 'all', 'auto' or -1, got {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a layer count >= 0, 'all', 'auto' or -1, got {n}")
    return n


@dataclass(frozen=True)
class PlacementSettings:
    """The user's placement choices (flags in parentheses).

    n_gpu_layers (-ngl): layers on the GPU counted from the last, the output head counting as one;
        None = all.
    cpu_moe (--cpu-moe) / n_cpu_moe (--n-cpu-moe): experts of every layer / of layers 0..N-1 stay on
        the CPU.
    override_tensor (-ot): "REGEX=DEVICE[,...]" specs as given; first match wins; they win over
        the shortcuts (parsed by placement.rules.parse_overrides).
    gpu_device (--gpu-device): the GPU (cuda:N or CUDAN; cpu for a CPU-only plan).
    fit (--fit, -ngl auto): choose how many expert layers go on the GPU to fit the VRAM budget.
    vram_budget (--vram-budget): GiB the plan may use on the GPU (None: free VRAM minus a margin).
    upload_buffers (--upload-buffers): GPU buffers, each one CPU layer's experts, that prompt
        batches stream experts into (0: prompt batches compute CPU experts on the CPU). One is llama.cpp's
        footprint; two let the next layer's upload overlap this layer's compute.
    gpu_dense_dtype (--gpu-dense-dtype): quantized non-expert weights (Q8_0 attention, output
        head) on a GPU: "stored" (decoded per call), or converted once at load to bf16/f16/f32;
        "auto" converts to f32 (bf16 with --fast-math) when that fits the VRAM budget (placement.plan).
    """

    n_gpu_layers: int | None = None
    cpu_moe: bool = False
    n_cpu_moe: int = 0
    override_tensor: Sequence[str] = ()
    gpu_device: str = "cuda:0"
    fit: bool = False
    vram_budget: float | None = None
    upload_buffers: int = 1
    gpu_dense_dtype: str = "auto"

    def __post_init__(self) -> None:
        require(self.n_gpu_layers is None or self.n_gpu_layers >= 0, "-ngl/--n-gpu-layers",
                "be >= 0 (None: all)", self.n_gpu_layers)
        require(self.n_cpu_moe >= 0, "--n-cpu-moe", "be >= 0", self.n_cpu_moe)
        require(not isinstance(self.override_tensor, str), "-ot/--override-tensor",
                "be a list of 'REGEX=DEVICE' strings, not a str", self.override_tensor)
        require(self.vram_budget is None or self.vram_budget > 0, "--vram-budget", "be > 0 GiB", self.vram_budget)
        require(self.upload_buffers >= 0, "--upload-buffers", "be >= 0", self.upload_buffers)
        require(self.gpu_dense_dtype in GPU_DENSE_DTYPES, "--gpu-dense-dtype",
                f"be one of {', '.join(GPU_DENSE_DTYPES)}", self.gpu_dense_dtype)

    def asks_for_gpu(self) -> bool:
        """Whether any choice only means something with a GPU (--cpu-moe alone does not)."""
        return bool(self.n_gpu_layers or self.n_cpu_moe or self.override_tensor or self.fit
                    or self.vram_budget is not None)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PlacementSettings:
        ngl: GpuLayers = args.n_gpu_layers
        # `-ngl auto` fits what the user left open, as llama.cpp's fitting does: with --cpu-moe or
        # --n-cpu-moe given, the expert layers are chosen already and every layer goes to the GPU.
        auto_fit = ngl == "auto" and not args.cpu_moe and not args.n_cpu_moe
        return cls(
            n_gpu_layers=ngl if isinstance(ngl, int) else None,
            cpu_moe=args.cpu_moe, n_cpu_moe=args.n_cpu_moe, override_tensor=tuple(args.override_tensor),
            gpu_device=args.gpu_device, fit=args.fit == "on" or auto_fit, vram_budget=args.vram_budget,
            upload_buffers=args.upload_buffers, gpu_dense_dtype=args.gpu_dense_dtype)


def add_placement_args(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    d = PlacementSettings()
    g = parser.add_argument_group("placement (llama.cpp's flags; docs/placement.md)")
    return [
        g.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", type=gpu_layers, default="all",
                       help="layers on the GPU, counted from the last (the output head counts as one): N, "
                            "all (-1), or auto (fit the expert layers to VRAM, as --fit) (default all)"),
        g.add_argument("--cpu-moe", "-cmoe", action="store_true", help="keep every expert tensor on the CPU"),
        g.add_argument("--n-cpu-moe", "-ncmoe", type=int, default=d.n_cpu_moe,
                       help="experts of layers 0..N-1 on the CPU"),
        g.add_argument("-ot", "--override-tensor", action="append", default=[],
                       help="REGEX=DEVICE[,...] (repeatable; first match wins; beats --cpu-moe/--n-cpu-moe)"),
        g.add_argument("--fit", nargs="?", const="on", default="off", type=on_off,
                       help="choose the most expert layers on the GPU that fit the VRAM budget"),
        g.add_argument("--vram-budget", type=float, default=d.vram_budget,
                       help="GiB the plan may use on the GPU (default: free VRAM minus a margin)"),
        g.add_argument("--gpu-device", default=d.gpu_device, help="the GPU (cuda:N, CUDAN, or cpu for CPU-only)"),
        g.add_argument("--upload-buffers", "--upload-slots", type=int, default=d.upload_buffers,
                       help="GPU buffers of one layer's CPU experts for prompt batches (0 = compute them on the CPU)"),
        g.add_argument("--gpu-dense-dtype", default=d.gpu_dense_dtype, choices=GPU_DENSE_DTYPES,
                       help="quantized non-expert weights on the GPU: auto = f32 (bf16 with --fast-math) when "
                            "it fits the VRAM budget, else kept as stored and decoded per call; or the given dtype"),
    ]
