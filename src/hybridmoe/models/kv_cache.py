"""Per-sequence KV cache: full-attention layers sized by context, sliding layers as ring buffers.

Sliding-window layers keep only `window + slack` rows, so their memory does not grow with
context. The slack lets a sequence roll back a few tokens (prefix reuse after the last turn's
end token is re-rendered) without recomputing the whole prompt; further rollbacks go through
snapshots (`snapshot`/`restore`): checkpoints of the ring layers alone, or the whole state for
the RAM prompt cache and slot files.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridmoe.models.kv_window import WindowGeometry


@dataclass(frozen=True)
class CacheLayout:
    n_layers: int
    sliding: tuple[bool, ...]  # per layer
    n_kv_heads: int
    head_dim: int
    window: int
    devices: tuple[torch.device, ...]  # per layer
    dtype: torch.dtype = torch.float32
    slack: int = 64

    def geometry(self, max_ctx: int) -> WindowGeometry:
        """The ring rule of a cache of `max_ctx` positions (window 0: no sliding layers)."""
        if not any(self.sliding):
            return WindowGeometry(0, 0)
        return WindowGeometry(self.window, min(max_ctx, self.window + self.slack))


@dataclass
class KVSnapshot:
    """A copy of a cache's state in RAM: ring layers whole (K, V, positions), full layers' first
    `length` positions or None (a checkpoint: the live cache's full layers are reused)."""

    length: int
    ring_lo: int
    layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None]

    @property
    def has_full_layers(self) -> bool:
        return all(t is not None for t in self.layers)

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for t in self.layers if t is not None for x in t if x is not None)


class SequenceKVCache:
    """KV storage for one sequence; `length` tokens are cached (positions 0..length-1)."""

    def __init__(self, layout: CacheLayout, max_ctx: int):
        if max_ctx <= 0:
            raise ValueError(f"max_ctx must be positive, got {max_ctx}")
        self.layout = layout
        self.max_ctx = max_ctx
        self.length = 0
        self.ring_lo = 0  # lowest position the ring layers still hold (see kv_window)
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._pos: list[torch.Tensor | None] = []  # ring layers: absolute position per row (-1 empty)
        self._arange: dict[torch.device, torch.Tensor] = {}
        ring = min(max_ctx, layout.window + layout.slack)
        for layer in range(layout.n_layers):
            rows = ring if layout.sliding[layer] else max_ctx
            shape = (layout.n_kv_heads, rows, layout.head_dim)  # head-major: attention reads rows
            dev = layout.devices[layer]
            self._k.append(torch.zeros(shape, dtype=layout.dtype, device=dev))
            self._v.append(torch.zeros(shape, dtype=layout.dtype, device=dev))
            if layout.sliding[layer]:
                self._pos.append(torch.full((rows,), -1, dtype=torch.long, device=dev))
            else:
                self._pos.append(None)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._k + self._v)

    @property
    def geometry(self) -> WindowGeometry:
        return self.layout.geometry(self.max_ctx)

    def update(
        self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, pos0: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store the chunk's keys/values (positions pos0..pos0+T-1) and return what it attends to.

        k_new, v_new: [T, Hkv, d]. Returns (k, v, k_pos): k, v [Hkv, S, d] holding every key the
        chunk's queries may see, with their absolute positions [S] (-1 = empty); the caller masks
        causality and the window by position, so ring order does not matter.
        """
        T = k_new.shape[0]
        if pos0 + T > self.max_ctx:
            raise ValueError(f"context overflow: {pos0 + T} tokens > context size {self.max_ctx}")
        K, V, P = self._k[layer], self._v[layer], self._pos[layer]
        # Slice writes convert to the cache's dtype in the copy itself (one op, not two).
        k_new, v_new = k_new.transpose(0, 1), v_new.transpose(0, 1)
        positions = self._positions(K.device)
        if P is None:
            K[:, pos0 : pos0 + T] = k_new
            V[:, pos0 : pos0 + T] = v_new
            return K[:, : pos0 + T], V[:, : pos0 + T], positions[: pos0 + T]
        rows = P.shape[0]
        # (Ring entries at or past pos0 cannot exist: truncate() hides a rolled-back future.)
        new_pos = positions[pos0 : pos0 + T]
        if T <= rows - self.layout.window + 1:
            # Writing first overwrites nothing the chunk's first query still needs: attend the ring.
            r0 = pos0 % rows
            if r0 + T <= rows:  # no wrap: slices (on an accelerator, no index tensors to launch)
                K[:, r0 : r0 + T] = k_new
                V[:, r0 : r0 + T] = v_new
                P[r0 : r0 + T] = new_pos
                return K, V, P
            idx = new_pos % rows
            K[:, idx] = k_new.to(K.dtype)
            V[:, idx] = v_new.to(V.dtype)
            P[idx] = new_pos
            return K, V, P
        k_new, v_new = k_new.to(K.dtype), v_new.to(V.dtype)
        k_all = torch.cat((K, k_new), dim=1)
        v_all = torch.cat((V, v_new), dim=1)
        pos_all = torch.cat((P, new_pos))
        keep = min(T, rows)
        idx = new_pos[T - keep :] % rows
        K[:, idx] = k_new[:, T - keep :]
        V[:, idx] = v_new[:, T - keep :]
        P[idx] = new_pos[T - keep :]
        return k_all, v_all, pos_all

    def _positions(self, device: torch.device) -> torch.Tensor:
        """0..max_ctx-1 on `device`, made once per cache: position ranges become views."""
        if device not in self._arange:
            self._arange[device] = torch.arange(self.max_ctx, device=device)
        return self._arange[device]

    def decode_row(self, layer: int, pos: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int]:
        """Where one new token at `pos` goes, for the in-place decode kernel (kernels.attn_decode).

        Returns (K, V, P, row, n_keys): the layer's storage, its ring positions (None for a full
        layer), the row to write, and how many leading rows the token attends over. A ring row is
        only ever overwritten by a position `rows >= window` newer, so what it held is out of the window.
        """
        if pos + 1 > self.max_ctx:
            raise ValueError(f"context overflow: {pos + 1} tokens > context size {self.max_ctx}")
        K, V, P = self._k[layer], self._v[layer], self._pos[layer]
        if P is None:
            return K, V, None, pos, pos + 1
        rows = P.shape[0]
        return K, V, P, pos % rows, rows

    def advance(self, n: int) -> None:
        self.length += n
        self.ring_lo = self.geometry.lo_after(self.ring_lo, self.length)

    def snapshot_nbytes(self) -> int:
        """What snapshot(full_layers=True) would take, without copying anything."""
        n = self.length
        total = 0
        for K, V, P in zip(self._k, self._v, self._pos):
            if P is not None:
                total += (K.numel() + V.numel()) * K.element_size() + P.numel() * P.element_size()
            else:
                total += (K[:, :n].numel() + V[:, :n].numel()) * K.element_size()
        return total

    def snapshot(self, full_layers: bool) -> KVSnapshot:
        """Copy the state to RAM. Without `full_layers` it is a checkpoint: restoring it needs this
        cache's full layers to still hold the same first `length` tokens."""
        n = self.length
        layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None] = []
        for K, V, P in zip(self._k, self._v, self._pos):
            if P is not None:
                layers.append((_to_ram(K), _to_ram(V), _to_ram(P)))
            elif full_layers:
                layers.append((_to_ram(K[:, :n]), _to_ram(V[:, :n]), None))
            else:
                layers.append(None)
        return KVSnapshot(n, self.ring_lo, layers)

    def restore(self, snap: KVSnapshot) -> None:
        """Make this cache hold `snap`'s state (full layers from the snapshot when it has them)."""
        if not 0 <= snap.ring_lo <= snap.length <= self.max_ctx:
            raise ValueError(f"snapshot of {snap.length} tokens (ring from {snap.ring_lo}) for a context of {self.max_ctx}")
        if len(snap.layers) != self.layout.n_layers:
            raise ValueError(f"snapshot has {len(snap.layers)} layers, the model {self.layout.n_layers}")
        for K, V, P, saved in zip(self._k, self._v, self._pos, snap.layers):
            if saved is None:
                if P is not None:
                    raise ValueError("snapshot lacks a sliding layer's state")
                continue
            k, v, p = saved
            if k.dtype != K.dtype or v.dtype != V.dtype or v.shape != k.shape:
                raise ValueError(f"snapshot tensors of {k.dtype}/{v.dtype} {tuple(k.shape)}/{tuple(v.shape)}, "
                                 f"cache {K.dtype}")
            if P is not None:
                if p is None or k.shape != K.shape or p.shape != P.shape or p.dtype != P.dtype:
                    raise ValueError(f"sliding-layer snapshot of shape {tuple(k.shape)}, cache {tuple(K.shape)}")
                K.copy_(k)
                V.copy_(v)
                P.copy_(p)
            else:
                if k.shape != (K.shape[0], snap.length, K.shape[2]):
                    raise ValueError(f"full-layer snapshot of shape {tuple(k.shape)} for {snap.length} tokens")
                K[:, : snap.length].copy_(k)
                V[:, : snap.length].copy_(v)
        self.length = snap.length
        self.ring_lo = snap.ring_lo

    def check_snapshot(self, snap: KVSnapshot) -> tuple[KVSnapshot, int]:
        """Raise ValueError unless `snap` (a checkpoint or whole state) fits this cache's shapes;
        returns it with its size."""
        if len(snap.layers) != self.layout.n_layers:
            raise ValueError(f"snapshot has {len(snap.layers)} layers, the model {self.layout.n_layers}")
        for K, P, saved in zip(self._k, self._pos, snap.layers):
            if P is not None and (saved is None or saved[0].shape != K.shape or saved[2] is None
                                  or saved[2].shape != P.shape or saved[1].shape != K.shape):
                raise ValueError("a sliding layer's snapshot does not fit the cache")
        if snap.length > self.max_ctx or not 0 <= snap.ring_lo <= snap.length:
            raise ValueError(f"snapshot of {snap.length} tokens (ring from {snap.ring_lo}) for a context of {self.max_ctx}")
        return snap, snap.nbytes

    def truncate(self, n: int) -> int:
        """Roll back to the first n tokens where the ring layers still hold what that needs.

        Returns the length actually kept (the caller re-feeds tokens from there).
        """
        n = max(0, min(n, self.length))
        if not self.geometry.can_roll_back(self.ring_lo, self.length, n):
            n = 0
        if n == 0:
            self.ring_lo = 0
            for P in self._pos:
                if P is not None:
                    P.fill_(-1)
        else:
            for P in self._pos:
                if P is not None:
                    P.masked_fill_(P >= n, -1)
        self.length = n
        return n


def _to_ram(t: torch.Tensor) -> torch.Tensor:
    return t.to("cpu", copy=True).contiguous() if t.device.type != "cpu" else t.clone(memory_format=torch.contiguous_format)
