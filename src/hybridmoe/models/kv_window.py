"""When a sliding-window KV state can be rolled back: pure arithmetic, no torch.

Sliding layers keep a ring of `ring` rows. After feeding positions up to `length - 1`, the ring
holds exactly positions `lo .. length - 1` (a rollback hides a suffix but never brings back what a
write overwrote). The next token at position n attends to n - window + 1 .. n - 1, so a state can
be rolled back to n when those are still held. The scheduler decides with this, the KV cache
enforces it: one rule for both.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WindowGeometry:
    window: int  # tokens a sliding layer attends over (0 = the model has no sliding layers)
    ring: int  # rows (positions) a sliding layer keeps (>= window)

    def lo_after(self, lo: int, length: int) -> int:
        """Lowest position still held once positions up to `length - 1` have been written."""
        return lo if self.window == 0 else max(lo, length - self.ring)

    def can_roll_back(self, lo: int, length: int, n: int) -> bool:
        """A state holding positions lo..length-1 can continue at position n (0 <= n <= length)."""
        if n == 0 or n == length or self.window == 0:
            return True
        return max(0, n - self.window + 1) >= lo
