"""Architecture-neutral building blocks: RMSNorm, YaRN RoPE tables, attention with sinks."""

from __future__ import annotations

import math

import torch

from hybridmoe import kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * g, in float32 (the gain is a plain multiply).

    Small float32 CPU inputs (decode steps) go through the C kernel: torch's CPU RMSNorm is a
    handful of ops, each slow right after a weight stream has flushed the caches."""
    if (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and x.numel() <= _C_NORM_MAX
            and kernels.available()):
        return kernels.rms_norm(x, weight, eps)
    return torch.nn.functional.rms_norm(x.float(), weight.shape, weight, eps)


_C_NORM_MAX = 64 * 8192  # elements; above this torch's vectorised, threaded op is the better choice


def yarn_inv_freq(
    head_dim: int,
    base: float,
    factor: float,
    original_ctx: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> tuple[torch.Tensor, float]:
    """NTK-by-parts YaRN inverse frequencies and the attention concentration (mscale).

    The correction range is NOT rounded (OpenAI's reference and HF with truncate=false);
    ggml rounds it to floor/ceil, which shifts pairs 9..17 of gpt-oss.
    """
    d_half = head_dim // 2
    i = torch.arange(d_half, dtype=torch.float64)
    freq = base ** (2.0 * i / head_dim)
    if factor <= 1.0:
        return (1.0 / freq).float(), 1.0
    low = d_half * math.log(original_ctx / (beta_fast * 2 * math.pi)) / math.log(base)
    high = d_half * math.log(original_ctx / (beta_slow * 2 * math.pi)) / math.log(base)
    # Clamped to [0, head_dim - 1] as transformers and ggml do: a small original context or base
    # gives low < 0 (a no-op for gpt-oss's own numbers).
    low, high = max(low, 0.0), min(high, head_dim - 1.0)
    if high == low:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((i - low) / (high - low)).clamp(0.0, 1.0)
    inv_freq = (1.0 / freq) * (1.0 - ramp) + (1.0 / (factor * freq)) * ramp
    concentration = 0.1 * math.log(factor) + 1.0
    return inv_freq.float(), concentration


class RopeTable:
    """cos/sin (already multiplied by the YaRN concentration) for positions, computed on demand."""

    def __init__(self, inv_freq: torch.Tensor, concentration: float):
        self.inv_freq = inv_freq
        self.concentration = concentration

    def cos_sin(self, positions: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, d] tables for `apply_rope_neox`: cos repeated, sin signed for rotate-half."""
        theta = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, d/2]
        cos = torch.cos(theta) * self.concentration
        sin = torch.sin(theta) * self.concentration
        cos2 = torch.cat((cos, cos), dim=-1)[:, None, :]
        sin2 = torch.cat((-sin, sin), dim=-1)[:, None, :]
        return cos2.to(device), sin2.to(device)


def apply_rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split (NeoX) rotation: dim i pairs with i + d/2. x: [T, heads, d]; cos/sin from
    `RopeTable.cos_sin`: out = x * cos + rotate_half(x) * sin, with rotate_half(x) = (x2, x1)."""
    d_half = x.shape[-1] // 2
    rot = torch.cat((x[..., d_half:], x[..., :d_half]), dim=-1)
    return torch.addcmul(x * cos, rot, sin)


def attention_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    window: int | None,
    q_block: int = 256,
    keys_in_order: bool = False,
    first_pos: int | None = None,
) -> torch.Tensor:
    """Causal GQA attention with one learned, unscaled sink logit per query head.

    q: [T, Hq, d]; k, v: [Hkv, S, d]; q_pos: [T]; k_pos: [S] absolute positions (-1 = an empty row).
    Query head h uses KV head h // (Hq // Hkv). A sliding window W admits keys p-W+1 .. p.
    The sink is an extra logit column that takes probability mass but has no value, so
    out = softmax-attention(q, k, v) * sigmoid(lse - sink), with lse the log-sum-exp of the
    scaled scores. Queries are processed in blocks to bound mask/score memory.
    keys_in_order: k_pos is 0..S-1 and the last query sits at S-1 (a full layer's cache).
    first_pos: q_pos[0] as a host int, when known: a one-query block then builds its mask from a
    scalar (no cache holds a position past the query: truncate() hides a rolled-back future).
    """
    T, Hq, d = q.shape
    Hkv, S, _ = k.shape
    g = Hq // Hkv
    sink = sinks.float().view(Hkv, g, 1)
    blocks = []
    for t0 in range(0, T, q_block):
        t1 = min(T, t0 + q_block)
        n = t1 - t0
        hidden = _hidden_keys(q_pos, k_pos, t0, t1, window, keys_in_order, first_pos)
        # GQA without copying K/V: the g query heads of a KV head become g*n query rows.
        qb = q[t0:t1].view(n, Hkv, g, d).permute(1, 2, 0, 3).reshape(Hkv, g * n, d)
        ob = _attend(qb, k, v, hidden, g, n, scale, sink)
        blocks.append(ob.view(Hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, Hq, d).to(q.dtype))
    # contiguous: the caller views it as [T, Hq * d] (a copy only where the layout needs one)
    return blocks[0].contiguous() if len(blocks) == 1 else torch.cat(blocks)


def _hidden_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, t0: int, t1: int, window: int | None,
                 keys_in_order: bool, first_pos: int | None) -> torch.Tensor | None:
    """[n, S] True where query t0+i must not see key j (causality, window, empty rows); None
    when every key is visible. Built with as few device ops as the case allows."""
    if t1 - t0 == 1 and first_pos is not None:
        if window is None and keys_in_order:
            return None  # one query after a contiguous prefix: every key is visible
        p = first_pos + t0
        low = max(p - window, -1) if window is not None else -1
        return (k_pos <= low)[None, :]  # every cached position is <= p
    qp = q_pos[t0:t1, None]
    hidden = (k_pos[None, :] > qp) | (k_pos[None, :] < 0)
    if window is not None:
        hidden |= k_pos[None, :] <= qp - window
    return hidden


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None, g: int, n: int,
            scale: float, sink: torch.Tensor) -> torch.Tensor:
    """Softmax attention with the sink column for R = g * n query rows: q [Hkv, R, d] -> [Hkv, R, d].
    hidden: [n, S] masked keys, or None; sink: [Hkv, g, 1] logits."""
    if q.device.type == "cpu":
        # One fused op on the CPU (flash kernel): no [heads, n, S] score tensor, and it returns
        # the log-sum-exp the sink correction needs.
        mask = None
        if hidden is not None and bool(hidden.any()):
            mask = torch.zeros(hidden.shape, dtype=q.dtype).masked_fill_(hidden, float("-inf")).repeat(g, 1)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None], k[None].to(q.dtype), v[None].to(q.dtype), 0.0, False, attn_mask=mask, scale=scale
        )
        Hkv, R, _ = q.shape
        return out[0] * torch.sigmoid(lse[0].view(Hkv, g, n) - sink).view(Hkv, R, 1)
    return attend_sink_column(q, k, v, hidden, g, n, scale, sink)


def attend_sink_column(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None, g: int,
                       n: int, scale: float, sink: torch.Tensor) -> torch.Tensor:
    """_attend in plain torch ops, few of them (each is a kernel launch on an accelerator): the
    sink is one more logit column of the softmax, whose probability multiplies no value."""
    Hkv, R, _ = q.shape
    S = k.shape[1]
    scores = torch.cat((torch.matmul(q * scale, k.transpose(1, 2).to(q.dtype)),
                        sink.expand(Hkv, g, n).reshape(Hkv, R, 1).to(q.dtype)), dim=-1)
    if hidden is not None:
        # rows are (head in group, query): one query's mask broadcasts, several repeat per head
        scores[..., :S].masked_fill_((hidden if n == 1 else hidden.repeat(g, 1))[None], float("-inf"))
    p = torch.softmax(scores.float(), dim=-1)[..., :S]
    return torch.matmul(p.to(v.dtype), v).to(q.dtype)
