"""Test helpers: give a loaded model's layer another expert backend (device code paths on the CPU)."""

from __future__ import annotations

import torch

from hybridmoe.models.device_options import DeviceOptions
from hybridmoe.models.routed_experts import RoutedExperts, load_layer_experts, make_routed_experts
from hybridmoe.models.gpt_oss import SWIGLU_ALPHA, SWIGLU_LIMIT, GptOss, tensor_names
from hybridmoe.models.experts_streamed import StreamCost


class AlwaysStream(StreamCost):
    """A cost model that streams every batch (the streamed path, whatever the batch size)."""

    def should_stream(self, n_hit: int, expert_bytes: int, n_pairs: int, hidden: int, ffn: int) -> bool:
        return True


def rebuild_experts(model: GptOss, i: int, kind: str, options: DeviceOptions | None = None,
                    device: str = "cpu") -> RoutedExperts:
    """Layer i's experts rebuilt as backend `kind` on `device` (activations and uploads there),
    sharing the model's buffers, as the loader would for a plan that put them there."""
    names = tensor_names(model.config, i)
    fused = names["gate_up_exps"] in model.file.tensors
    dev = torch.device(device)
    experts = make_routed_experts(
        kind, load_layer_experts(model.file, names, fused, model.config.expert_ffn), activations_device=dev,
        experts_device=dev, alpha=SWIGLU_ALPHA, limit=SWIGLU_LIMIT, act=model.activations,
        buffers=model.buffers, options=options or DeviceOptions())
    model.layers[i].moe.experts = experts
    return experts
