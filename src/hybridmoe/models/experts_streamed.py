"""CPU-resident experts whose big batches are computed on the accelerator.

For a large prompt batch, uploading only the experts the batch routes to and computing them on
the device beats the CPU kernels (llama.cpp's op offload, copying only used experts). The upload
goes in chunks that alternate between two device upload buffers, so the next chunk's upload
(copy stream) overlaps this chunk's compute. `StreamCost` decides per layer and step, from the
actual number of hit experts, whether a batch streams or runs staged on the CPU kernels.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridmoe import kernels
from hybridmoe.models.device_experts import RawExperts, combine, expert_rows, group_rows
from hybridmoe.models.device_sync import DeviceSync
from hybridmoe.models.experts_cpu import StagedExperts
from hybridmoe.models.model_buffers import ModelBuffers
from hybridmoe.placement.expert_backends import STREAMED

log = logging.getLogger(__name__)


@dataclass(frozen=True)
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
class UploadBuffer:
    host: list[torch.Tensor]  # gate, up, down (uint8), gate_b, up_b, down_b (f32); pinned on CUDA
    dev: list[torch.Tensor]
    host_free: Any = None  # event: the upload out of `host` finished
    dev_free: Any = None  # event: the compute reading `dev` finished


class UploadBufferPair:
    """Two upload buffers used in turn, across chunks and across layers."""

    def __init__(self, buffers: list[UploadBuffer]):
        self.buffers = buffers
        self.turn = 0

    def next(self) -> UploadBuffer:
        self.turn += 1
        return self.buffers[self.turn % 2]


def expert_bytes(experts: kernels.ExpertTensors) -> int:
    """Raw bytes of one expert (gate + up + down rows)."""
    return sum(int(np.prod(a.shape[1:])) for a in (experts.gate, experts.up, experts.down))


class ExpertStreamer:
    """Uploads the experts a batch routes to (chunks in two alternating buffers) and computes them.

    The raw blocks are gathered from the mmap into a pinned host buffer, copied to the device
    buffer on a copy stream, and computed on the current stream once that copy's event fires;
    while a chunk computes, the next chunk is gathered and uploaded into the other buffer.
    upload_layers: the two buffers together hold this many layers' experts.
    """

    def __init__(self, experts: kernels.ExpertTensors, alpha: float, limit: float, device: torch.device,
                 buffers: ModelBuffers, upload_layers: int, dtype: torch.dtype, decode_budget_bytes: int):
        self.src = experts
        self.alpha, self.limit = alpha, limit
        self.device = torch.device(device)
        self.dtype = dtype
        self.decode_budget_bytes = decode_budget_bytes
        self.per_buffer = max(1, math.ceil(experts.num_experts * max(1, upload_layers) / 2))
        self.sync: DeviceSync = buffers.sync(self.device)
        self._buffers = buffers

    @property
    def uploads(self) -> UploadBufferPair:
        """The model's upload buffers for this shape, made on the first streamed batch."""
        ex = self.src
        key = ("uploads", self.device, self.per_buffer, ex.gate.shape[1:], ex.down.shape[1:])
        return self._buffers.shared(key, lambda: UploadBufferPair(self._make_buffers()))

    def _make_buffers(self) -> list[UploadBuffer]:
        ex, n = self.src, self.per_buffer
        parts = [(ex.gate, torch.uint8), (ex.up, torch.uint8), (ex.down, torch.uint8)]
        shapes = [((n,) + a.shape[1:], dt) for a, dt in parts]
        H, I = ex.dims()
        shapes += [((n, I), torch.float32), ((n, I), torch.float32), ((n, H), torch.float32)]
        return [
            UploadBuffer([self.sync.pinned(s, dt) for s, dt in shapes],
                         [torch.empty(s, dtype=dt, device=self.device) for s, dt in shapes])
            for _ in range(2)
        ]

    def _gather(self, buf: UploadBuffer, chunk: np.ndarray) -> None:
        """Copy the chunk's raw blocks and biases from the mmap into the host buffer."""
        ex, c = self.src, len(chunk)
        for j, a in enumerate((ex.gate, ex.up, ex.down)):
            np.take(a, chunk, axis=0, out=buf.host[j][:c].numpy(), mode="clip")  # clip: unbuffered
        idx = torch.from_numpy(chunk)
        for j, b in enumerate((ex.gate_bias, ex.up_bias, ex.down_bias)):
            if b is None:
                buf.host[3 + j][:c].zero_()
            else:
                torch.index_select(b, 0, idx, out=buf.host[3 + j][:c])

    def _upload(self, buf: UploadBuffer, c: int) -> Any:
        s = self.sync
        with s.on_copy_stream():
            s.stream_wait(buf.dev_free, s.copy_stream)  # don't overwrite a buffer in use
            for d, h in zip(buf.dev, buf.host):
                d[:c].copy_(h[:c], non_blocking=True)
            done = s.record(s.copy_stream)
        buf.host_free = done
        return done

    def __call__(self, h: torch.Tensor, ids_host: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """h [T, H] and weights [T, k] on the device; ids_host [T, k] int on the CPU."""
        ex = self.src
        H = h.shape[1]
        uploads = self.uploads
        # Grouping on the host (ids are there already): no device sync inside the chunk loop.
        grouping = group_rows(ids_host, ex.num_experts).to(self.device)
        hit = grouping.hit()
        x = h.index_select(0, grouping.tok).to(self.dtype)  # [R, H] rows in expert order
        y = torch.empty((x.shape[0], H), dtype=torch.float32, device=self.device)
        for start in range(0, len(hit), self.per_buffer):
            chunk = hit[start : start + self.per_buffer]
            buf = uploads.next()
            self.sync.host_wait(buf.host_free)  # its previous upload has left the pinned buffer
            self._gather(buf, np.asarray(chunk, dtype=np.int64))
            self.sync.stream_wait(self._upload(buf, len(chunk)))
            c = len(chunk)
            raw = RawExperts(*(t[:c] for t in buf.dev), ggml_type=ex.ggml_type, down_type=ex.down_type)
            expert_rows(x, y, grouping.starts, raw, [(e, j) for j, e in enumerate(chunk)], self.alpha,
                        self.limit, self.dtype, self.decode_budget_bytes)
            buf.dev_free = self.sync.record()
        out = torch.zeros((h.shape[0], H), dtype=torch.float32, device=self.device)
        return combine(out, y, grouping, weights)


class StreamedExperts:
    """Experts in the mmap, activations on `device`: each batch streamed or staged, whichever
    `cost` estimates faster for the experts it actually hits (decode stays staged)."""

    kind = STREAMED

    def __init__(self, staged: StagedExperts, streamer: ExpertStreamer, cost: StreamCost):
        self.staged = staged
        self.streamer = streamer
        self.cost = cost
        ex = streamer.src
        self.expert_bytes = expert_bytes(ex)
        self.dims = ex.dims()
        self.last_path = ""  # "staged" | "streamed": the path of the last call (tests, logs)

    def worth_streaming(self, ids_host: torch.Tensor) -> bool:
        n_hit = int(np.unique(ids_host.numpy()).size)
        H, I = self.dims
        stream = self.cost.should_stream(n_hit, self.expert_bytes, ids_host.numel(), H, I)
        log.debug("%d tokens hit %d experts: %s", ids_host.shape[0], n_hit, "stream" if stream else "CPU")
        return stream

    def __call__(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # One packed copy brings x, ids and weights to the host: the decision and the CPU kernels
        # need the ids there, and for a batch that streams the extra x bytes are small.
        x_host, ids_host, w_host = self.staged.fetch(h, ids, weights)
        if self.worth_streaming(ids_host):
            self.last_path = "streamed"
            return self.streamer(h.float(), ids_host, weights.float())
        self.last_path = "staged"
        return self.staged.compute(x_host, ids_host, w_host)
