"""CPU-resident experts serving activations that live on an accelerator.

Two ways to run a layer whose experts stay in the GGUF mmap:
  * `HostRoute`: only the hidden states and the routing (ids, weights) cross to the CPU kernels
    and the result comes back, through pinned buffers reused across steps (kt-kernel's idea of
    submit/wait around the CPU MoE, written for our kernels' `moe_forward_submit`).
  * `ExpertStreamer`: for large prompt batches, upload only the experts the batch routes to and
    compute them on the device (llama.cpp's op offload, copying only used experts), in chunks
    that alternate between two device staging slots so the next chunk's upload (copy stream)
    overlaps this chunk's compute.
`StreamCost` decides between them per layer and step from the actual number of hit experts.

Every piece also runs with the "device" being the CPU (no streams, no pinning) so the logic is
tested on machines without CUDA; `OffloadOptions.stage_on_cpu`/`stream` force the paths there.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hybridmoe import kernels
from hybridmoe.models.device_experts import (
    DEFAULT_DECODE_BUDGET_BYTES,
    RawExperts,
    combine,
    expert_rows,
    group_rows,
)

log = logging.getLogger(__name__)


@dataclass
class StreamCost:
    """Per-layer cost model: stream the hit experts to the device, or run them on the CPU?

    cpu_s    = max(hit_bytes / cpu_gbps, flops / cpu_gflops)          (kernel: bandwidth or compute)
    stream_s = max(hit_bytes / pcie_gbps, hit_bytes / host_copy_gbps)  (DMA and mmap->pinned copy
               + flops / gpu_tflops + overhead_s                         run pipelined, chunk-wise)
    with flops = 6 * H * I * (routed token-expert pairs). Defaults: cpu_gbps / cpu_gflops are the
    2-thread MXFP4 kernels on a 2-vCPU Zen 3 (bench/kernels.py: ~16 GB/s
    cold GEMV, ~100 GFLOP/s batched); pcie_gbps is PCIe 4.0 x16 in practice (~25 GB/s);
    host_copy_gbps a single-threaded page-cache -> pinned copy; gpu_tflops a modest bf16 figure
    for skinny per-expert matmuls; overhead_s covers syncs and launches. Measure your machine
    (bench/kernels.py for the CPU side) and set them; with the defaults, gpt-oss-20b streams from
    about 20 tokens per step and decode stays on the CPU.
    """

    cpu_gbps: float = 16.0
    cpu_gflops: float = 100.0
    pcie_gbps: float = 25.0
    host_copy_gbps: float = 10.0
    gpu_tflops: float = 100.0
    overhead_s: float = 2e-4

    def cpu_s(self, hit_bytes: int, flops: float) -> float:
        return max(hit_bytes / (self.cpu_gbps * 1e9), flops / (self.cpu_gflops * 1e9))

    def stream_s(self, hit_bytes: int, flops: float) -> float:
        move = max(hit_bytes / (self.pcie_gbps * 1e9), hit_bytes / (self.host_copy_gbps * 1e9))
        return move + flops / (self.gpu_tflops * 1e12) + self.overhead_s

    def should_stream(self, n_hit: int, expert_bytes: int, n_pairs: int, hidden: int, ffn: int) -> bool:
        """True when uploading the n_hit experts and computing on the device is estimated faster."""
        hit_bytes = n_hit * expert_bytes
        flops = 6.0 * hidden * ffn * n_pairs
        return self.stream_s(hit_bytes, flops) < self.cpu_s(hit_bytes, flops)


@dataclass
class OffloadOptions:
    """How expert layers and dense weights run off the CPU-only path.

    compute_dtype: dtype of device expert matmuls (None: bf16 on CUDA, float32 on the CPU).
    decode_budget_bytes: decoded expert weights alive at once on the device.
    upload_slots: device staging for streamed experts, in units of one layer's expert bytes
        (split into two alternating buffers); 0 disables streaming (the plan's `upload_slots`).
    stream: "auto" (cost model, only when activations are off the CPU), "always", "never".
    stage_on_cpu: route CPU-activation calls through the staging buffers too (tests).
    gpu_dense_dtype: dense weights on an accelerator, weights.DenseLinear's dtype ("stored",
        "bf16", "f16", "f32"; None = bf16); CPU-placed dense weights ignore it.
    """

    compute_dtype: torch.dtype | None = None
    decode_budget_bytes: int = DEFAULT_DECODE_BUDGET_BYTES
    upload_slots: int = 1
    stream: str = "auto"
    stage_on_cpu: bool = False
    gpu_dense_dtype: str | None = None
    cost: StreamCost = field(default_factory=StreamCost)

    def __post_init__(self) -> None:
        if self.stream not in ("auto", "always", "never"):
            raise ValueError(f"stream must be 'auto', 'always' or 'never', got {self.stream!r}")
        if self.upload_slots < 0:
            raise ValueError(f"upload_slots must be >= 0, got {self.upload_slots}")

    def dtype_for(self, device: torch.device) -> torch.dtype:
        if self.compute_dtype is not None:
            return self.compute_dtype
        return torch.float32 if device.type == "cpu" else torch.bfloat16

    def dense_dtype(self, device: torch.device) -> str | None:
        """DenseLinear dtype for a dense weight placed on `device` (None = its default)."""
        return None if torch.device(device).type == "cpu" else self.gpu_dense_dtype

    @classmethod
    def from_placement(cls, placement: Any) -> "OffloadOptions":
        """Options from a placement plan's `options` (upload_slots, gpu_dense_dtype); defaults
        for anything else (e.g. a plain all-CPU placement)."""
        opts = getattr(placement, "options", None)
        return cls(upload_slots=getattr(opts, "upload_slots", 1),
                   gpu_dense_dtype=getattr(opts, "gpu_dense_dtype", None))


def _pinned(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


class _Events:
    """A device's copy stream and event helpers; no-ops (all synchronous) unless it is CUDA."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None

    def record(self, stream: Any = None) -> Any:
        """An event marking the work queued so far on `stream` (default: the current stream)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return ev

    def on_copy_stream(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.copy_stream) if self.cuda else contextlib.nullcontext()

    def stream_wait(self, ev: Any, stream: Any = None) -> None:
        """Later work on `stream` (default: current) starts after `ev`; the host does not block."""
        if ev is not None:
            (stream if stream is not None else torch.cuda.current_stream(self.device)).wait_event(ev)

    @staticmethod
    def host_wait(ev: Any) -> None:
        if ev is not None:
            ev.synchronize()


# Staging buffers are shared by all layers with the same shapes: layers run one after another
# (one engine thread), so one set serves the whole model instead of one per layer (120b: 36x).
_SHARED: dict[tuple, Any] = {}


def _shared(key: tuple, make: Any) -> Any:
    if key not in _SHARED:
        _SHARED[key] = make()
    return _SHARED[key]


class _RouteBuffers:
    """Pinned (on CUDA machines) x / ids / weights / out buffers, grown to the largest batch."""

    def __init__(self, hidden: int, k: int):
        self.hidden, self.k = hidden, k
        self.pin = torch.cuda.is_available()
        self.capacity = 0
        self.out_free: Any = None  # event: the last H2D copy out of `out` finished

    def grow(self, T: int) -> None:
        if T <= self.capacity:
            return
        _Events.host_wait(self.out_free)  # no copy may still read the buffer being replaced
        cap = 1 << max(0, T - 1).bit_length()
        self.x = _pinned((cap, self.hidden), torch.float32, self.pin)
        self.ids = _pinned((cap, self.k), torch.int32, self.pin)
        self.wts = _pinned((cap, self.k), torch.float32, self.pin)
        self.out = _pinned((cap, self.hidden), torch.float32, self.pin)
        self.capacity, self.out_free = cap, None


def _events(device: torch.device) -> _Events:
    return _shared(("events", device), lambda: _Events(device))  # one copy stream per device


class HostRoute:
    """Hidden states + routing to the CPU kernels and back, through reusable (pinned) buffers.

    `submit` copies in and starts the kernels on their worker thread; `wait` copies the result
    back to the activations' device. The buffers are shared by every layer, so only one
    submitted layer may be in flight at a time.
    """

    def __init__(self, experts: kernels.ExpertTensors, alpha: float, limit: float):
        self.experts = experts
        self.alpha, self.limit = alpha, limit
        self.hidden = experts.dims()[0]

    def submit(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> Any:
        """Start the CPU experts for h [T, H], ids [T, k], weights [T, k] (any device)."""
        T, k = ids.shape
        buf = _shared(("route", self.hidden, k), lambda: _RouteBuffers(self.hidden, k))
        buf.grow(T)
        x, i, w = buf.x[:T], buf.ids[:T], buf.wts[:T]
        x.copy_(h, non_blocking=True)
        i.copy_(ids, non_blocking=True)
        w.copy_(weights, non_blocking=True)
        if h.device.type == "cuda":
            torch.cuda.current_stream(h.device).synchronize()  # D2H landed before the CPU reads
        fut = kernels.moe_forward_submit(x, i, w, self.experts, swiglu_alpha=self.alpha,
                                         swiglu_limit=self.limit)
        return fut, buf, h.device, T

    def wait(self, handle: Any) -> torch.Tensor:
        """[T, H] float32 on the activations' device."""
        fut, buf, device, T = handle
        y = fut.result()
        if device.type != "cuda":
            return y.to(device)
        _Events.host_wait(buf.out_free)  # the previous layer's upload out of `out` is done
        buf.out[:T].copy_(y)
        res = torch.empty((T, self.hidden), dtype=torch.float32, device=device)
        res.copy_(buf.out[:T], non_blocking=True)
        buf.out_free = torch.cuda.Event()
        buf.out_free.record(torch.cuda.current_stream(device))
        return res

    def __call__(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.wait(self.submit(h, ids, weights))


@dataclass
class _Slot:
    host: list[torch.Tensor]  # gate, up, down (uint8), gate_b, up_b, down_b (f32); pinned on CUDA
    dev: list[torch.Tensor]
    host_free: Any = None  # event: the upload out of `host` finished
    dev_free: Any = None  # event: the compute reading `dev` finished


class _SlotPair:
    """Two staging slots used in turn, across chunks and across layers."""

    def __init__(self, slots: list[_Slot]):
        self.slots = slots
        self.turn = 0

    def next(self) -> _Slot:
        self.turn += 1
        return self.slots[self.turn % 2]


class ExpertStreamer:
    """Uploads the experts a batch routes to (chunks in two alternating slots) and computes them.

    The raw blocks are gathered from the mmap into a pinned host slot, copied to the device slot
    on a copy stream, and computed on the current stream once that copy's event fires; while a
    chunk computes, the next chunk is gathered and uploaded into the other slot.
    """

    def __init__(self, experts: kernels.ExpertTensors, alpha: float, limit: float,
                 device: torch.device, opts: OffloadOptions):
        self.src = experts
        self.alpha, self.limit = alpha, limit
        self.device = torch.device(device)
        self.opts = opts
        self.dtype = opts.dtype_for(self.device)
        E = experts.num_experts
        # Two slots share the budget of `upload_slots` layers' experts.
        self.per_slot = max(1, math.ceil(E * max(1, opts.upload_slots) / 2))
        self.events = _events(self.device)
        ex = experts
        key = ("slots", self.device, self.per_slot, ex.gate.shape[1:], ex.down.shape[1:])
        self.slots: _SlotPair = _shared(key, lambda: _SlotPair(self._make_slots()))

    def _make_slots(self) -> list[_Slot]:
        pin = self.events.cuda
        ex, n = self.src, self.per_slot
        parts = [(ex.gate, torch.uint8), (ex.up, torch.uint8), (ex.down, torch.uint8)]
        shapes = [((n,) + a.shape[1:], dt) for a, dt in parts]
        H, I = ex.dims()
        shapes += [((n, I), torch.float32), ((n, I), torch.float32), ((n, H), torch.float32)]
        return [
            _Slot([_pinned(s, dt, pin) for s, dt in shapes],
                  [torch.empty(s, dtype=dt, device=self.device) for s, dt in shapes])
            for _ in range(2)
        ]

    def _gather(self, slot: _Slot, chunk: np.ndarray) -> None:
        """Copy the chunk's raw blocks and biases from the mmap into the host slot."""
        ex, c = self.src, len(chunk)
        for j, a in enumerate((ex.gate, ex.up, ex.down)):
            np.take(a, chunk, axis=0, out=slot.host[j][:c].numpy(), mode="clip")  # clip: unbuffered
        idx = torch.from_numpy(chunk)
        for j, b in enumerate((ex.gate_bias, ex.up_bias, ex.down_bias)):
            if b is None:
                slot.host[3 + j][:c].zero_()
            else:
                torch.index_select(b, 0, idx, out=slot.host[3 + j][:c])

    def _upload(self, slot: _Slot, c: int) -> Any:
        ev = self.events
        with ev.on_copy_stream():
            ev.stream_wait(slot.dev_free, ev.copy_stream)  # don't overwrite a slot in use
            for d, s in zip(slot.dev, slot.host):
                d[:c].copy_(s[:c], non_blocking=True)
            done = ev.record(ev.copy_stream)
        slot.host_free = done
        return done

    def __call__(self, h: torch.Tensor, ids_host: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """h [T, H] and weights [T, k] on the device; ids_host [T, k] int on the CPU."""
        ex = self.src
        H = h.shape[1]
        # Grouping on the host (ids are there already): no device sync inside the chunk loop.
        grouping = group_rows(ids_host, ex.num_experts).to(self.device)
        hit = grouping.hit()
        x = h.index_select(0, grouping.tok).to(self.dtype)  # [R, H] rows in expert order
        y = torch.empty((x.shape[0], H), dtype=torch.float32, device=self.device)
        for start in range(0, len(hit), self.per_slot):
            chunk = hit[start : start + self.per_slot]
            slot = self.slots.next()
            _Events.host_wait(slot.host_free)  # its previous upload has left the pinned buffer
            self._gather(slot, np.asarray(chunk, dtype=np.int64))
            self.events.stream_wait(self._upload(slot, len(chunk)))
            c = len(chunk)
            raw = RawExperts(*(t[:c] for t in slot.dev), ggml_type=ex.ggml_type, down_type=ex.ggml_type)
            expert_rows(x, y, grouping.starts, raw, [(e, j) for j, e in enumerate(chunk)], self.alpha,
                        self.limit, self.dtype, self.opts.decode_budget_bytes)
            slot.dev_free = self.events.record()
        out = torch.zeros((h.shape[0], H), dtype=torch.float32, device=self.device)
        return combine(out, y, grouping, weights)


def expert_bytes(experts: kernels.ExpertTensors) -> int:
    """Raw bytes of one expert (gate + up + down rows)."""
    return sum(int(np.prod(a.shape[1:])) for a in (experts.gate, experts.up, experts.down))


class HostExperts:
    """A layer's experts in the mmap: CPU kernels (HostRoute) or streamed (ExpertStreamer)."""

    def __init__(self, experts: kernels.ExpertTensors, alpha: float, limit: float, opts: OffloadOptions):
        self.experts = experts
        self.alpha, self.limit = alpha, limit
        self.opts = opts
        self.route = HostRoute(experts, alpha, limit)
        self.expert_bytes = expert_bytes(experts)
        self._streamers: dict[torch.device, ExpertStreamer] = {}
        self.last_path = ""  # "cpu" | "staged" | "streamed": which path the last call took

    def wants_stream(self, device: torch.device, ids_host: torch.Tensor) -> bool:
        o = self.opts
        if o.stream == "never" or o.upload_slots == 0:
            return False
        if o.stream == "always":
            return True
        if device.type == "cpu":
            return False
        n_hit = int(np.unique(ids_host.numpy()).size)
        H, I = self.experts.dims()
        stream = o.cost.should_stream(n_hit, self.expert_bytes, ids_host.numel(), H, I)
        log.debug("%d tokens hit %d experts: %s", ids_host.shape[0], n_hit, "stream" if stream else "CPU")
        return stream

    def __call__(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        dev = h.device
        if dev.type == "cpu" and not self.opts.stage_on_cpu and self.opts.stream != "always":
            self.last_path = "cpu"
            return kernels.moe_forward(h.float().contiguous(), ids.contiguous(), weights.float().contiguous(),
                                       self.experts, swiglu_alpha=self.alpha, swiglu_limit=self.limit)
        ids_host = ids.to("cpu", torch.int32)  # small; the decision and the CPU kernels need it
        if self.wants_stream(dev, ids_host):
            self.last_path = "streamed"
            if dev not in self._streamers:
                self._streamers[dev] = ExpertStreamer(self.experts, self.alpha, self.limit, dev, self.opts)
            return self._streamers[dev](h.float(), ids_host, weights.float())
        self.last_path = "staged"
        return self.route(h.float(), ids_host, weights.float())
