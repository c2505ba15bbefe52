"""gpt-oss (20b / 120b), read top to bottom like the model card.

Per layer: RMSNorm -> GQA attention with q/k/v/o biases, NeoX YaRN RoPE and one learned sink
logit per head (sliding window of 128 on even layers, full causal on odd ones) -> residual ->
RMSNorm -> router top-k then softmax over the k -> clamped SwiGLU experts with biases ->
residual. Final RMSNorm and an untied output head. See docs/gpt-oss.md.

Expert tensors stay in the GGUF mmap and run through `hybridmoe.kernels` when placed on the
CPU; every other tensor is loaded onto its placed device (CPU float32 by default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from hybridmoe import kernels
from hybridmoe.gguf.reader import ModelFile
from hybridmoe.models.gpt_oss_config import ARCH, SWIGLU_ALPHA, SWIGLU_LIMIT, GptOssConfig
from hybridmoe.models.kv_cache import CacheLayout, SequenceKVCache
from hybridmoe.models.layers import (
    RopeTable,
    apply_rope_neox,
    attention_with_sinks,
    rms_norm,
    yarn_inv_freq,
)
from hybridmoe.models.offload import OffloadOptions
from hybridmoe.models.weights import DenseLinear, ExpertLayer, load_f32
from hybridmoe.quant.torch_dequant import dequantize_torch

__all__ = ["ARCH", "GptOss", "GptOssConfig", "SeqChunk"]


def tensor_names(cfg: GptOssConfig, layer: int) -> dict[str, str]:
    """Our parameter name -> GGUF tensor name for one layer (llama.cpp's converter's names)."""
    p = f"blk.{layer}."
    return {
        "attn_norm": p + "attn_norm.weight",
        "q": p + "attn_q.weight", "q_bias": p + "attn_q.bias",
        "k": p + "attn_k.weight", "k_bias": p + "attn_k.bias",
        "v": p + "attn_v.weight", "v_bias": p + "attn_v.bias",
        "o": p + "attn_output.weight", "o_bias": p + "attn_output.bias",
        "sinks": p + "attn_sinks.weight",
        "mlp_norm": p + "post_attention_norm.weight",
        "router": p + "ffn_gate_inp.weight", "router_bias": p + "ffn_gate_inp.bias",
        "gate_exps": p + "ffn_gate_exps.weight", "gate_exps_bias": p + "ffn_gate_exps.bias",
        "up_exps": p + "ffn_up_exps.weight", "up_exps_bias": p + "ffn_up_exps.bias",
        "gate_up_exps": p + "ffn_gate_up_exps.weight", "gate_up_exps_bias": p + "ffn_gate_up_exps.bias",
        "down_exps": p + "ffn_down_exps.weight", "down_exps_bias": p + "ffn_down_exps.bias",
    }


def expected_shapes(cfg: GptOssConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """GGUF ne (innermost first) of every required tensor of one layer."""
    H, D, E, I = cfg.hidden, cfg.head_dim, cfg.n_experts, cfg.expert_ffn
    q, kv = cfg.n_heads * D, cfg.n_kv_heads * D
    return {
        "attn_norm": (H,), "q": (H, q), "q_bias": (q,), "k": (H, kv), "k_bias": (kv,),
        "v": (H, kv), "v_bias": (kv,), "o": (q, H), "o_bias": (H,), "sinks": (cfg.n_heads,),
        "mlp_norm": (H,), "router": (H, E), "router_bias": (E,),
        "gate_exps": (H, I, E), "gate_exps_bias": (I, E), "up_exps": (H, I, E), "up_exps_bias": (I, E),
        "gate_up_exps": (H, 2 * I, E), "gate_up_exps_bias": (2 * I, E),
        "down_exps": (I, H, E), "down_exps_bias": (H, E),
    }


class Placement(Protocol):
    def device_of(self, name: str) -> str: ...


class _AllOn:
    def __init__(self, device: str):
        self.device = device

    def device_of(self, name: str) -> str:
        return self.device


@dataclass
class SeqChunk:
    """Tokens to append to one sequence; their positions continue at cache.length."""

    cache: SequenceKVCache
    tokens: list[int]


class _Layer:
    def __init__(self, model: "GptOss", mf: ModelFile, cfg: GptOssConfig, i: int, placement: Placement):
        names = tensor_names(cfg, i)
        shapes = expected_shapes(cfg, i)
        fused = names["gate_up_exps"] in mf.tensors
        for key, name in names.items():
            if key.startswith(("gate_exps", "up_exps")) and fused:
                continue
            if key.startswith("gate_up_exps") and not fused:
                continue
            mf.require(name, shapes[key])
        self.device = torch.device(placement.device_of(names["q"]))
        dev = self.device
        off = OffloadOptions.from_placement(placement)
        self.sliding = cfg.layer_is_sliding(i)
        self.attn_norm = load_f32(mf, names["attn_norm"], dev)
        self.q = DenseLinear(mf, names["q"], names["q_bias"], dev, off.dense_dtype(dev))
        self.k = DenseLinear(mf, names["k"], names["k_bias"], dev, off.dense_dtype(dev))
        self.v = DenseLinear(mf, names["v"], names["v_bias"], dev, off.dense_dtype(dev))
        self.o = DenseLinear(mf, names["o"], names["o_bias"], dev, off.dense_dtype(dev))
        # q, k, v read by the C kernel from the mmap: one call for the three (decode steps are
        # short enough that a call's fixed cost shows).
        parts = (self.q, self.k, self.v)
        self.qkv = None
        if all(p.raw is not None and p.ggml_type == self.q.ggml_type for p in parts):
            self.qkv = kernels.LinearGroup([p.raw for p in parts], [p.bias for p in parts], self.q.ggml_type)
        self.sinks = load_f32(mf, names["sinks"], dev)
        mlp_dev = torch.device(placement.device_of(names["router"]))
        self.mlp_device = mlp_dev
        self.mlp_norm = load_f32(mf, names["mlp_norm"], mlp_dev)
        self.router_w = load_f32(mf, names["router"], mlp_dev)
        self.router_b = load_f32(mf, names["router_bias"], mlp_dev)
        exp_name = names["gate_up_exps" if fused else "gate_exps"]
        self.experts = ExpertLayer(
            mf, names, fused, torch.device(placement.device_of(exp_name)),
            cfg.expert_ffn, SWIGLU_ALPHA, SWIGLU_LIMIT, offload=off,
        )


class GptOss:
    """The model: weights, forward over a batch of sequence chunks, cache factory."""

    def __init__(self, model_file: ModelFile, placement: Placement | None = None, progress: bool = False):
        self.config = cfg = GptOssConfig.from_metadata(model_file.metadata, model_file.path)
        self.file = model_file
        placement = placement or _AllOn("cpu")
        self.placement = placement
        H, V = cfg.hidden, cfg.vocab_size
        mf = model_file
        mf.require("token_embd.weight", (H, V))
        mf.require("output_norm.weight", (H,))
        mf.require("output.weight", (H, V))
        # The embedding is a row gather: it stays in the mmap on the CPU (as llama.cpp does).
        self.embd_raw = mf.raw("token_embd.weight")
        self.embd_type = mf.tensors["token_embd.weight"].ggml_type
        layers = range(cfg.n_layers)
        if progress:
            from tqdm import tqdm

            layers = tqdm(layers, desc="loading layers", unit="layer")
        self._swa_full = False
        self.layers = [_Layer(self, mf, cfg, i, placement) for i in layers]
        out_dev = torch.device(placement.device_of("output.weight"))
        self.out_device = out_dev
        self.output_norm = load_f32(mf, "output_norm.weight", out_dev)
        self.output = DenseLinear(
            mf, "output.weight", None, out_dev, OffloadOptions.from_placement(placement).dense_dtype(out_dev)
        )
        inv_freq, conc = yarn_inv_freq(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_factor, cfg.rope_original_ctx,
            cfg.yarn_beta_fast, cfg.yarn_beta_slow,
        )
        self.rope = RopeTable(inv_freq, conc)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    # --- cache ---------------------------------------------------------------------------
    def cache_layout(self, dtype: torch.dtype | None = None) -> CacheLayout:
        """KV in float32 on the CPU (exact); float16 when any layer is on an accelerator, where
        VRAM is the budget (llama.cpp's default KV type)."""
        cfg = self.config
        if dtype is None:
            on_cpu = all(layer.device.type == "cpu" for layer in self.layers)
            dtype = torch.float32 if on_cpu else torch.float16
        return CacheLayout(
            n_layers=cfg.n_layers,
            sliding=tuple(cfg.layer_is_sliding(i) for i in range(cfg.n_layers)),
            n_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim,
            window=cfg.sliding_window,
            devices=tuple(layer.device for layer in self.layers),
            dtype=dtype,
            # --swa-full: sliding layers as long as the context, so any cached prefix can be reused.
            **({"slack": 2**31} if self._swa_full else {}),
        )

    def use_full_swa_cache(self) -> None:
        """llama.cpp's --swa-full: caches made from now on keep every position in sliding-window
        layers too (more memory; a slot can roll back to any prefix instead of window + slack)."""
        self._swa_full = True

    def make_cache(self, max_ctx: int) -> SequenceKVCache:
        return SequenceKVCache(self.cache_layout(), max_ctx)

    # --- forward -------------------------------------------------------------------------
    def embed(self, ids: np.ndarray) -> torch.Tensor:
        rows = np.ascontiguousarray(self.embd_raw[ids])
        return dequantize_torch(torch.from_numpy(rows), self.embd_type)

    # torch's own intra-op pool only pays for big steps: on small (decode) steps its wake-ups cost
    # more than the tiny ops it splits (measured 6x slower per step with 2 threads), and the heavy
    # work runs in the kernels' own pool anyway.
    torch_threads: int = 1
    PARALLEL_TORCH_MIN_TOKENS = 64

    def forward(self, chunks: list[SeqChunk], all_logits: bool = False) -> torch.Tensor:
        """Run all chunks' tokens as one batch; logits for each chunk's last token (or all)."""
        n_tokens = sum(len(c.tokens) for c in chunks)
        want = self.torch_threads if n_tokens >= self.PARALLEL_TORCH_MIN_TOKENS else 1
        prev = torch.get_num_threads()
        if want != prev:
            torch.set_num_threads(want)
        try:
            return self._forward(chunks, all_logits)
        finally:
            if want != prev:
                torch.set_num_threads(prev)

    @torch.inference_mode()
    def _forward(self, chunks: list[SeqChunk], all_logits: bool) -> torch.Tensor:
        cfg = self.config
        if not chunks or any(len(c.tokens) == 0 for c in chunks):
            raise ValueError("forward needs at least one token per chunk")
        for c in chunks:
            if c.cache.length + len(c.tokens) > c.cache.max_ctx:
                raise ValueError(
                    f"context overflow: {c.cache.length} cached + {len(c.tokens)} new tokens "
                    f"> context size {c.cache.max_ctx}"
                )
        ids = np.fromiter((t for c in chunks for t in c.tokens), dtype=np.int64)
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(f"token id out of range 0..{cfg.vocab_size - 1}")
        lens = [len(c.tokens) for c in chunks]
        positions = torch.cat([torch.arange(c.cache.length, c.cache.length + n) for c, n in zip(chunks, lens)])
        N = len(ids)
        Hq, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        x = self.embed(ids)
        pos0s = [c.cache.length for c in chunks]
        rope_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        qpos_cache: dict[torch.device, list[torch.Tensor]] = {}
        for li, layer in enumerate(self.layers):
            dev = layer.device
            x = x.to(dev)
            if dev not in rope_cache:
                rope_cache[dev] = self.rope.cos_sin(positions, dev)
                pdev = positions.to(dev)
                qpos_cache[dev] = list(torch.split(pdev, lens))
            cos, sin = rope_cache[dev]
            h = rms_norm(x, layer.attn_norm, cfg.rms_eps)
            if layer.qkv is not None:
                q, k, v = torch.split(layer.qkv(h), layer.qkv.sizes, dim=1)
            else:
                q, k, v = layer.q(h), layer.k(h), layer.v(h)
            q, k, v = q.view(N, Hq, D), k.view(N, Hkv, D), v.view(N, Hkv, D)
            window = cfg.sliding_window if layer.sliding else None
            one_call = dev.type == "cpu" and kernels.available()
            outs = []
            off = 0
            for c, n, pos0, q_pos in zip(chunks, lens, pos0s, qpos_cache[dev]):
                if n == 1 and one_call and c.cache.layout.dtype == torch.float32:
                    # Decode: rope, cache write and attention in one C call (see attn_decode).
                    kc, vc, kpos, slot, n_keys = c.cache.decode_slot(li, pos0)
                    outs.append(kernels.attn_decode(
                        q[off], k[off], v[off], cos[off, 0], sin[off, 0], kc, vc, slot, kpos, pos0,
                        n_keys, window or 0, layer.sinks, self.scale,
                    )[None])
                    off += n
                    continue
                qc = apply_rope_neox(q[off : off + n], cos[off : off + n], sin[off : off + n])
                kr = apply_rope_neox(k[off : off + n], cos[off : off + n], sin[off : off + n])
                k_all, v_all, k_pos = c.cache.update(li, kr, v[off : off + n], pos0)
                outs.append(
                    attention_with_sinks(
                        qc, k_all, v_all, layer.sinks,
                        q_pos, k_pos, self.scale, window, keys_in_order=not layer.sliding,
                    )
                )
                off += n
            attn = torch.cat(outs).view(N, Hq * D)
            x = x + layer.o(attn)
            x = x.to(layer.mlp_device)
            h = rms_norm(x, layer.mlp_norm, cfg.rms_eps)
            x = x + self.moe(layer, h)
        for c, n in zip(chunks, lens):
            c.cache.advance(n)
        if not all_logits:
            last = torch.tensor(np.cumsum(lens) - 1)
            x = x[last.to(x.device)]
        x = rms_norm(x.to(self.out_device), self.output_norm, cfg.rms_eps)
        return self.output(x)

    def moe(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        """Router top-k on raw logits, softmax over the k, weighted sum of the chosen experts."""
        logits = torch.nn.functional.linear(h, layer.router_w, layer.router_b)
        vals, idx = torch.topk(logits, self.config.n_experts_used, dim=-1)
        weights = torch.softmax(vals, dim=-1)
        return layer.experts(h, idx.to(torch.int32), weights)
