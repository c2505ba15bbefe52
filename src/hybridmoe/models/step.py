"""One forward step: the chunks it extends and their positions, with rope tables per device."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridmoe.models.kv_cache import SequenceKVCache
from hybridmoe.models.layers import RopeTable


@dataclass
class SeqChunk:
    """Tokens to append to one sequence; their positions continue at cache.length. The step
    returns logits for the chunk's last `n_logits` tokens (a speculative draft needs them all)."""

    cache: SequenceKVCache
    tokens: list[int]
    n_logits: int = 1


@dataclass
class StepBatch:
    """All chunks of one step as one batch of rows: chunk i owns rows offsets[i]..offsets[i]+lens[i]-1."""

    chunks: list[SeqChunk]
    rope: RopeTable
    lens: list[int] = field(init=False)
    pos0s: list[int] = field(init=False)
    _tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]] = field(
        init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.lens = [len(c.tokens) for c in self.chunks]
        self.pos0s = [c.cache.length for c in self.chunks]
        self.positions = torch.cat([torch.arange(p, p + n) for p, n in zip(self.pos0s, self.lens)])

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """cos, sin [N, 1, d] and each chunk's query positions, on `device` (made once per step)."""
        if device not in self._tables:
            cos, sin = self.rope.cos_sin(self.positions, device)
            self._tables[device] = (cos, sin, list(torch.split(self.positions.to(device), self.lens)))
        return self._tables[device]
