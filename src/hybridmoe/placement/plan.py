"""The placement plan: every tensor -> `cpu` (used in place from the mmap) or `cuda:N`, decided
once from the GGUF header and the options, before anything is loaded, with per-device bytes.
`place` applies the rules for given numerics; placement.fit's make_plan chooses those (and --fit's
expert layers) to fit the VRAM budget.

Rules, in llama.cpp's order and meaning (docs/placement.md):
  1. the token embedding stays on the CPU (a row gather per token; llama.cpp does the same);
  2. `-ot REGEX=DEVICE` rules, first match wins;
  3. `--cpu-moe` (experts of every layer -> cpu), then `--n-cpu-moe N` (experts of layers 0..N-1);
  4. `-ngl N`: layer il goes to the GPU when il >= n_layers + 1 - N; the output head and final
     norm count as layer n_layers, so they are on the GPU whenever N >= 1. Default: all.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from hybridmoe.gguf.constants import GGMLType
from hybridmoe.gpt_oss_config import GptOssConfig
from hybridmoe.quant.formats import Q8_0_EXACT_TYPES
from hybridmoe.placement.expert_backends import expert_backend, experts_device
from hybridmoe.placement.memory import ComputeEstimate, estimate_compute, gib, layer_kv_bytes
from hybridmoe.placement.rules import (
    CPU,
    KIND_EMBEDDING,
    KIND_EXPERTS,
    KINDS,
    PlacementError,
    Rule,
    cpu_moe_rules,
    first_match,
    n_cpu_moe_rules,
    normalize_device,
    parse_overrides,
    tensor_kind,
    tensor_layer,
)
from hybridmoe.settings import ContextSettings, ParallelSettings, PlacementSettings, SettingsError


DENSE_DTYPE_BYTES = {"stored": None, "bf16": 2, "f16": 2, "f32": 4}


class TensorLike(Protocol):
    """What the plan reads from gguf.reader.TensorInfo."""

    name: str
    ggml_type: GGMLType
    ne: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class PlacementOptions:
    """The plan's input: the user's placement choices and the sizes the plan accounts memory for.

    placement: settings.PlacementSettings (its docstring gives each field's flag and meaning;
        it validates itself).
    ctx_size (-c): total context in tokens, split evenly across the n_parallel sequences (as in
        llama-server and `hybridmoe serve`); 0 = the model's training context.
    n_parallel (-np): sequences (serving slots) at once.
    batch_size: tokens per forward step (ContextSettings.step_tokens, min(-b, -ub)); sizes compute
        buffers and the sliding-window KV.
    kv_dtype_bytes: bytes per cached K/V value on a GPU (4 = f32, 2 = f16); None = auto (below).
    fast_math: the model's --fast-math, which sets the GPU numerics. Off: float32 everywhere, so
        the GPU path keeps the CPU path's accuracy; auto picks f32 dense weights and an f32 KV
        cache when they fit the VRAM budget, else dense weights stored (Q8_0, decoded to float32
        per call), then an f16 cache (noted). On: bf16 dense weights and expert matmuls, f16 cache
        (llama.cpp's numerics). Without a known budget auto picks the smaller choice.
    The sizes' defaults describe one short sequence (a library or test plan); `serve` and `plan`
    pass theirs from settings.ContextSettings / ParallelSettings.
    """

    placement: PlacementSettings = field(default_factory=PlacementSettings)
    ctx_size: int = 4096
    n_parallel: int = 1
    batch_size: int = ContextSettings().step_tokens
    kv_dtype_bytes: float | None = None
    fast_math: bool = False

    def validate(self) -> None:
        try:
            ContextSettings(ctx_size=self.ctx_size, batch_size=self.batch_size, ubatch_size=self.batch_size)
            ParallelSettings(n_parallel=self.n_parallel)
        except SettingsError as e:
            raise PlacementError(str(e)) from None
        if self.kv_dtype_bytes is not None and self.kv_dtype_bytes <= 0:
            raise PlacementError(f"kv_dtype_bytes must be > 0, got {self.kv_dtype_bytes}")
        try:
            normalize_device(self.placement.gpu_device)
        except PlacementError as e:
            raise PlacementError(f"--gpu-device: {e}") from None


@dataclass(frozen=True)
class TensorPlacement:
    name: str
    device: str
    kind: str
    layer: int | None  # None for the embedding and the output-layer tensors
    type: str  # ggml type name, e.g. "MXFP4"
    nbytes: int  # bytes in the file
    rule: str  # which rule decided the device
    device_bytes: int  # bytes where it lives (differs from nbytes when converted on a GPU)


@dataclass
class DeviceUsage:
    device: str
    weights_by_kind: dict[str, int]
    kv_bytes: int
    compute: ComputeEstimate

    @property
    def weights_bytes(self) -> int:
        return sum(self.weights_by_kind.values())

    @property
    def compute_bytes(self) -> int:
        return self.compute.total

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.compute_bytes

    def as_dict(self) -> dict[str, Any]:
        return {"weights_bytes": self.weights_bytes, "kv_bytes": self.kv_bytes,
                "compute_bytes": self.compute_bytes, "total_bytes": self.total_bytes,
                "weights_by_kind": dict(self.weights_by_kind),
                "compute_detail": self.compute.as_dict()}


@dataclass
class RamSide:
    """Host memory: CPU tensors are used in place from the mmap, so they need page cache."""

    mmap_expert_bytes: int  # expert tensors on the CPU: read on every token, must stay cached
    mmap_other_bytes: int  # other CPU tensors (token embedding, CPU layers; Q8_0 copies, see _device_bytes)
    kv_bytes: int
    compute_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.mmap_expert_bytes + self.mmap_other_bytes + self.kv_bytes + self.compute_bytes

    def as_dict(self) -> dict[str, int]:
        return {"mmap_expert_bytes": self.mmap_expert_bytes,
                "mmap_other_bytes": self.mmap_other_bytes, "kv_bytes": self.kv_bytes,
                "compute_bytes": self.compute_bytes, "total_bytes": self.total_bytes}


@dataclass
class Plan:
    tensors: list[TensorPlacement]
    devices: dict[str, DeviceUsage]  # GPU device(s) first, then "cpu"
    ram: RamSide
    layer_devices: list[str]  # where each layer's attention (and KV) lives
    expert_devices: list[str]  # where each layer's expert weights live
    expert_backends: list[str]  # each layer's placement.expert_backends kind (cpu/staged/stream/gpu)
    options: PlacementOptions
    ctx_size: int  # total context, resolved (0 -> model context)
    ctx_per_slot: int
    notes: list[str] = field(default_factory=list)
    _by_name: dict[str, TensorPlacement] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._by_name = {t.name: t for t in self.tensors}

    def device_of(self, name: str) -> str:
        """Device of tensor `name` ('cpu' or 'cuda:N')."""
        try:
            return self._by_name[name].device
        except KeyError:
            raise PlacementError(f"tensor {name!r} is not in the plan (not in the model file)") from None

    @property
    def gpu_device(self) -> str:
        return normalize_device(self.options.placement.gpu_device)

    @property
    def n_gpu_expert_layers(self) -> int:
        return sum(d != CPU for d in self.expert_devices)

    def to_json(self) -> dict[str, Any]:
        opts = dataclasses.asdict(self.options)
        opts["ctx_size_resolved"] = self.ctx_size
        opts["ctx_per_slot"] = self.ctx_per_slot
        return {
            "devices": {d: u.as_dict() for d, u in self.devices.items()},
            "ram": self.ram.as_dict(),
            "n_gpu_expert_layers": self.n_gpu_expert_layers,
            "options": opts,
            "layers": [{"layer": i, "attention": attn, "experts": exp, "expert_backend": kind}
                       for i, (attn, exp, kind) in enumerate(zip(self.layer_devices, self.expert_devices,
                                                                 self.expert_backends))],
            "notes": list(self.notes),
            "tensors": [{"name": t.name, "device": t.device, "type": t.type, "bytes": t.nbytes,
                         "device_bytes": t.device_bytes, "kind": t.kind, "layer": t.layer,
                         "rule": t.rule} for t in self.tensors],
        }


def _override_rules(p: PlacementSettings, n_layers: int) -> list[Rule]:
    rules = parse_overrides(list(p.override_tensor), p.gpu_device)
    if p.cpu_moe:
        rules += cpu_moe_rules()
    if p.n_cpu_moe:
        rules += n_cpu_moe_rules(min(p.n_cpu_moe, n_layers))  # N >= n_layers == --cpu-moe
    return rules


def _q8_0_copy(info: TensorLike, kind: str) -> bool:
    """A dense matrix the model holds as an exact Q8_0 copy (models.weights.stored_blocks); the
    embedding (a row gather from the mmap) and routed experts stay as stored."""
    return info.ggml_type in Q8_0_EXACT_TYPES and kind not in (KIND_EXPERTS, KIND_EMBEDDING)


def _device_bytes(info: TensorLike, device: str, kind: str, gpu_dense_dtype: str) -> int:
    per = DENSE_DTYPE_BYTES[gpu_dense_dtype]
    if _q8_0_copy(info, kind) and (per is None or device == CPU):
        return math.prod(int(d) for d in info.ne) // 32 * 34
    if per is None or device == CPU or kind == KIND_EXPERTS or info.ggml_type == GGMLType.F32:
        return int(info.nbytes)
    return math.prod(int(d) for d in info.ne) * per


def _conversion_note(tensors: list[TensorPlacement], gpu_dense_dtype: str) -> list[str]:
    """What the model converts to Q8_0 at load, said once: types, tensor counts, bytes before/after."""
    conv: dict[str, list[int]] = {}
    exact = {q.name for q in Q8_0_EXACT_TYPES}
    for t in tensors:
        held_q8 = t.device == CPU or DENSE_DTYPE_BYTES[gpu_dense_dtype] is None
        if t.type in exact and t.kind not in (KIND_EXPERTS, KIND_EMBEDDING) and held_q8:
            c = conv.setdefault(t.type, [0, 0, 0])
            c[0] += 1
            c[1] += t.nbytes
            c[2] += t.device_bytes
    return [f"{n} dense {name} tensors ({gib(a)}) held as Q8_0 ({gib(b)}): the same values, Q8_0's kernels"
            for name, (n, a, b) in sorted(conv.items())]


def _assign(cfg: GptOssConfig, tensors: dict[str, TensorLike], p: PlacementSettings
            ) -> list[TensorPlacement]:
    L = cfg.n_layers
    gpu = normalize_device(p.gpu_device)
    ngl = L + 1 if p.n_gpu_layers is None else p.n_gpu_layers
    gpu_start = max(L + 1 - ngl, 0)  # first layer index on the GPU; index L = output layer
    rules = _override_rules(p, L)
    out = []
    for name, info in tensors.items():
        kind, layer = tensor_kind(name), tensor_layer(name)
        if kind == KIND_EMBEDDING:
            device, why = CPU, "token embedding: always cpu (row gather)"
        elif (rule := first_match(rules, name)) is not None:
            device, why = rule.device, rule.describe()
        else:
            il = L if layer is None else layer
            on_gpu = il >= gpu_start
            device = gpu if on_gpu else CPU
            what = "output layer" if layer is None else f"layer {il}"
            why = f"-ngl {'all' if p.n_gpu_layers is None else ngl}: {what} on {device}"
        out.append(TensorPlacement(name, device, kind, layer, info.ggml_type.name,
                                   int(info.nbytes), why, _device_bytes(info, device, kind, p.gpu_dense_dtype)))
    return out


def _layer_devices(cfg: GptOssConfig, placed: dict[str, TensorPlacement], upload_buffers: int
                   ) -> tuple[list[str], list[str], list[str]]:
    """Per layer: where attention (and KV) runs, where the experts run, and the expert backend the
    model will load (placement.expert_backends' rules, the ones the model applies)."""
    expert_parts: dict[int, list[str]] = {}
    for t in placed.values():
        if t.kind == KIND_EXPERTS and t.layer is not None:
            expert_parts.setdefault(t.layer, []).append(t.device)
    attn, experts, backends = [], [], []
    for i in range(cfg.n_layers):
        k = placed.get(f"blk.{i}.attn_k.weight") or placed.get(f"blk.{i}.attn_q.weight")
        if k is None:
            raise PlacementError(f"layer {i}: no attn_k/attn_q weight in the tensor index")
        attn.append(k.device)
        experts.append(experts_device(expert_parts.get(i, [])))
        # The MoE's activations live where its router does (the model's MoEBlock.device).
        router = placed.get(f"blk.{i}.ffn_gate_inp.weight")
        backends.append(expert_backend(router.device if router else k.device, experts[-1], upload_buffers))
    return attn, experts, backends


def _account(cfg: GptOssConfig, tensors: list[TensorPlacement], opts: PlacementOptions
             ) -> Plan:
    ctx = opts.ctx_size or cfg.context_length
    per_slot = ctx // opts.n_parallel
    if per_slot < 1:
        raise PlacementError(f"context {ctx} split across {opts.n_parallel} slots leaves none per slot")
    placed = {t.name: t for t in tensors}
    attn_dev, exp_dev, backends = _layer_devices(cfg, placed, opts.placement.upload_buffers)
    out_t = placed.get("output.weight")
    out_dev = out_t.device if out_t else attn_dev[-1]

    gpu = normalize_device(opts.placement.gpu_device)
    names = [gpu] if gpu != CPU else []
    names += sorted({t.device for t in tensors if t.device not in (CPU, gpu)})
    names.append(CPU)
    weights = {d: {k: 0 for k in KINDS} for d in names}
    for t in tensors:
        weights[t.device][t.kind] += t.device_bytes
    kv = {d: 0 for d in names}
    for i in range(cfg.n_layers):
        kv[attn_dev[i]] += layer_kv_bytes(cfg, i, per_slot, opts.batch_size, opts.n_parallel,
                                          opts.kv_dtype_bytes)
    cpu_expert_bytes = [0] * cfg.n_layers
    for t in tensors:
        if t.kind == KIND_EXPERTS and t.device == CPU and t.layer is not None \
                and t.layer < cfg.n_layers:
            cpu_expert_bytes[t.layer] += t.nbytes

    devices = {}
    for d in names:
        upload = 0
        if d != CPU and opts.placement.upload_buffers:
            staged = [cpu_expert_bytes[i] for i in range(cfg.n_layers) if attn_dev[i] == d]
            upload = opts.placement.upload_buffers * max(staged, default=0)
        compute = estimate_compute(
            cfg, ubatch=opts.batch_size, ctx_size=per_slot, n_parallel=opts.n_parallel,
            runs_layers=d in attn_dev, runs_experts=d in exp_dev, runs_output=d == out_dev,
            upload_bytes=upload)
        devices[d] = DeviceUsage(d, {k: v for k, v in weights[d].items() if v}, kv[d], compute)

    cpu_t = [t for t in tensors if t.device == CPU]
    ram = RamSide(
        mmap_expert_bytes=sum(t.nbytes for t in cpu_t if t.kind == KIND_EXPERTS),
        mmap_other_bytes=sum(t.device_bytes for t in cpu_t if t.kind != KIND_EXPERTS),
        kv_bytes=devices[CPU].kv_bytes, compute_bytes=devices[CPU].compute_bytes)
    plan = Plan(tensors, devices, ram, attn_dev, exp_dev, backends, opts, ctx, per_slot)
    plan.notes.extend(_conversion_note(tensors, opts.placement.gpu_dense_dtype))
    return plan


def place(cfg: GptOssConfig, tensors: dict[str, TensorLike], opts: PlacementOptions) -> Plan:
    """Every tensor's device by the rules and the bytes each device needs, for options whose
    numerics are resolved (dense dtype not "auto", kv_dtype_bytes given: placement.fit's make_plan)."""
    return _account(cfg, _assign(cfg, tensors, opts.placement), opts)
