"""gpt-oss (20b / 120b), read top to bottom like the model card.

Per layer: RMSNorm -> GQA attention with q/k/v/o biases, NeoX YaRN RoPE and one learned sink
logit per head (sliding window of 128 on even layers, full causal on odd ones) -> residual ->
RMSNorm -> router top-k then softmax over the k -> clamped SwiGLU experts with biases ->
residual. Final RMSNorm and an untied output head. See docs/gpt-oss.md.

Where each part runs (C kernels on the mmap, torch on an accelerator, experts streamed) is
decided once at load: the routed experts' backend by routed_experts.load_routed_experts from
the placement, the attention's by attention.pick_attention.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from hybridmoe import kernels
from hybridmoe.gguf.reader import ModelFile
from hybridmoe.gpt_oss_config import ARCH, SWIGLU_ALPHA, SWIGLU_LIMIT, GptOssConfig
from hybridmoe.models.attention import kv_dtype_for, pick_attention
from hybridmoe.models.device_options import DeviceOptions
from hybridmoe.models.kv_cache import CacheLayout, SequenceKVCache
from hybridmoe.models.layers import RopeTable, rms_norm, yarn_inv_freq
from hybridmoe.models.loader import AllOn, Placement, WeightLoader
from hybridmoe.models.routed_experts import RoutedExperts, load_routed_experts
from hybridmoe.models.step import SeqChunk, StepBatch
from hybridmoe.models.weights import qkv_projection
from hybridmoe.placement.plan import Plan
from hybridmoe.quant.torch_dequant import dequantize_torch

__all__ = ["ARCH", "GptOss", "SeqChunk"]


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


def _check_layer_tensors(mf: ModelFile, cfg: GptOssConfig, i: int) -> tuple[dict[str, str], bool]:
    """Every tensor of layer i present with its shape; returns the names and whether gate/up are
    one fused tensor."""
    names = tensor_names(cfg, i)
    shapes = expected_shapes(cfg, i)
    fused = names["gate_up_exps"] in mf.tensors
    absent = ("gate_exps", "up_exps") if fused else ("gate_up_exps",)
    for key, name in names.items():
        if not key.startswith(absent):
            mf.require(name, shapes[key])
    return names, fused


class AttentionBlock:
    """RMSNorm -> q/k/v projections -> rope, KV cache, attention with sinks -> output projection."""

    def __init__(self, load: WeightLoader, cfg: GptOssConfig, i: int, names: dict[str, str], kv_dtype: torch.dtype):
        self.device = load.device(names["q"])
        self.cfg = cfg
        self.norm = load.f32(names["attn_norm"])
        q, k, v = (load.dense(names[p], names[p + "_bias"]) for p in ("q", "k", "v"))
        self.qkv = qkv_projection(q, k, v, load.act)
        self.o = load.dense(names["o"], names["o_bias"])
        window = cfg.sliding_window if cfg.layer_is_sliding(i) else None
        self.attend = pick_attention(i, self.device, kv_dtype, cfg.n_heads, load.f32(names["sinks"]),
                                     1.0 / math.sqrt(cfg.head_dim), window)

    def __call__(self, x: torch.Tensor, step: StepBatch) -> torch.Tensor:
        cfg = self.cfg
        x = x.to(self.device)
        N = x.shape[0]
        qkv = self.qkv(rms_norm(x, self.norm, cfg.rms_eps))  # [N, (Hq + 2 Hkv) d]
        out = self.attend(qkv.view(N, cfg.n_heads + 2 * cfg.n_kv_heads, cfg.head_dim), step)
        return x + self.o(out.view(N, cfg.n_heads * cfg.head_dim))


class MoEBlock:
    """RMSNorm -> router top-k on raw logits, softmax over the k -> clamped SwiGLU experts."""

    def __init__(self, load: WeightLoader, cfg: GptOssConfig, names: dict[str, str], fused: bool):
        self.device = load.device(names["router"])
        self.cfg = cfg
        self.norm = load.f32(names["mlp_norm"])
        self.router_w = load.f32(names["router"])
        self.router_b = load.f32(names["router_bias"])
        self.experts: RoutedExperts = load_routed_experts(load, names, fused, cfg.expert_ffn, self.device,
                                                          SWIGLU_ALPHA, SWIGLU_LIMIT)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.device)
        # CPU experts with the kernels run the whole block in one call: a decode step's ~8 small
        # torch ops would each cost several times their warm time after the experts' weight stream.
        if getattr(self.experts, "fuses_block", False):
            return self.experts.block(x.float(), self.norm, self.cfg.rms_eps, self.router_w, self.router_b,
                                      self.cfg.n_experts_used)
        h = rms_norm(x, self.norm, self.cfg.rms_eps)
        logits = torch.nn.functional.linear(h, self.router_w, self.router_b)
        vals, idx = torch.topk(logits, self.cfg.n_experts_used, dim=-1)
        return x + self.experts(h, idx, torch.softmax(vals, dim=-1))  # idx int64: no conversion launch


class TransformerBlock:
    """One layer: attention block, then MoE block, each adding to the residual stream."""

    def __init__(self, load: WeightLoader, cfg: GptOssConfig, i: int, kv_dtype: torch.dtype):
        names, fused = _check_layer_tensors(load.file, cfg, i)
        self.attention = AttentionBlock(load, cfg, i, names, kv_dtype)
        self.moe = MoEBlock(load, cfg, names, fused)

    @property
    def device(self) -> torch.device:
        """Where the layer's attention and KV cache live."""
        return self.attention.device

    def __call__(self, x: torch.Tensor, step: StepBatch) -> torch.Tensor:
        return self.moe(self.attention(x, step))


class GptOss:
    """The model: weights, forward over a batch of sequence chunks, cache factory.

    fast_math: int8 activations in this model's kernel calls (kernels.Activations); or set
    `activations` directly (INT16 for the two-term int16 GEMV path).
    device_options: how off-CPU weights are held (default: from the plan, else DeviceOptions()).
    The model owns its staging/upload buffers (`buffers`); they go when it goes.
    """

    def __init__(self, model_file: ModelFile, placement: Placement | None = None, progress: bool = False, *,
                 fast_math: bool = False, activations: kernels.Activations | None = None,
                 device_options: DeviceOptions | None = None):
        self.config = cfg = GptOssConfig.from_metadata(model_file.metadata, model_file.path)
        self.file = mf = model_file
        self.placement = placement = placement or AllOn("cpu")
        if device_options is None:
            device_options = DeviceOptions.from_plan(placement) if isinstance(placement, Plan) else DeviceOptions()
        self.activations = activations if activations is not None else kernels.Activations.for_fast_math(fast_math)
        load = WeightLoader(mf, placement, device_options, self.activations)
        self.buffers = load.buffers
        H, V = cfg.hidden, cfg.vocab_size
        mf.require("token_embd.weight", (H, V))
        mf.require("output_norm.weight", (H,))
        mf.require("output.weight", (H, V))
        # The embedding is a row gather: it stays in the mmap on the CPU (as llama.cpp does).
        self.embd_raw = mf.raw("token_embd.weight")
        self.embd_type = mf.tensors["token_embd.weight"].ggml_type
        self.kv_dtype = kv_dtype_for([load.device(tensor_names(cfg, i)["q"]) for i in range(cfg.n_layers)],
                                     device_options.kv_dtype)
        layers = range(cfg.n_layers)
        if progress:
            from tqdm import tqdm

            layers = tqdm(layers, desc="loading layers", unit="layer")
        self._swa_full = False
        self.layers = [TransformerBlock(load, cfg, i, self.kv_dtype) for i in layers]
        self.out_device = load.device("output.weight")
        self.output_norm = load.f32("output_norm.weight")
        self.output = load.dense("output.weight", None)
        inv_freq, conc = yarn_inv_freq(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_factor, cfg.rope_original_ctx,
            cfg.yarn_beta_fast, cfg.yarn_beta_slow,
        )
        self.rope = RopeTable(inv_freq, conc)

    @property
    def expert_backends(self) -> list[str]:
        """The routed-expert backend of each layer ("cpu" | "staged" | "stream" | "gpu")."""
        return [layer.moe.experts.kind for layer in self.layers]

    # --- cache ---------------------------------------------------------------------------
    def cache_layout(self) -> CacheLayout:
        cfg = self.config
        return CacheLayout(
            n_layers=cfg.n_layers,
            sliding=tuple(cfg.layer_is_sliding(i) for i in range(cfg.n_layers)),
            n_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim,
            window=cfg.sliding_window,
            devices=tuple(layer.device for layer in self.layers),
            dtype=self.kv_dtype,
            # --swa-full: sliding layers as long as the context, so any cached prefix can be reused.
            **({"slack": 2**31} if self._swa_full else {}),
        )

    def use_full_swa_cache(self) -> None:
        """llama.cpp's --swa-full: caches made from now on keep every position in sliding-window
        layers too (more memory; a sequence can roll back to any prefix instead of window + slack)."""
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
        """Run all chunks' tokens as one batch; logits for each chunk's last `n_logits` tokens (or all)."""
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

    def _check(self, chunks: list[SeqChunk]) -> np.ndarray:
        """The step's token ids, after checking chunk sizes, context room and the id range."""
        if not chunks or any(len(c.tokens) == 0 for c in chunks):
            raise ValueError("forward needs at least one token per chunk")
        for c in chunks:
            if c.cache.length + len(c.tokens) > c.cache.max_ctx:
                raise ValueError(
                    f"context overflow: {c.cache.length} cached + {len(c.tokens)} new tokens "
                    f"> context size {c.cache.max_ctx}"
                )
        ids = np.fromiter((t for c in chunks for t in c.tokens), dtype=np.int64)
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"token id out of range 0..{self.config.vocab_size - 1}")
        return ids

    @torch.inference_mode()
    def _forward(self, chunks: list[SeqChunk], all_logits: bool) -> torch.Tensor:
        ids = self._check(chunks)
        step = StepBatch(chunks, self.rope)
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, step)
        for c, n in zip(chunks, step.lens):
            c.cache.advance(n)
        if not all_logits:
            ends = np.cumsum(step.lens)
            rows = [np.arange(e - min(c.n_logits, n), e) for c, n, e in zip(chunks, step.lens, ends)]
            x = x[torch.from_numpy(np.concatenate(rows)).to(x.device)]
        x = rms_norm(x.to(self.out_device), self.output_norm, self.config.rms_eps)
        return self.output(x)
