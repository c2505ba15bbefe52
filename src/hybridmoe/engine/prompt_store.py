"""The prompt cache across restarts (`serve --prompt-cache-dir DIR`).

At shutdown the states worth keeping (each slot's, each RAM-cache entry's) are written to DIR as
slot files (engine/slot_files.py: model identity, SHA-256), newest first up to the RAM cache's
limit; at the next start they are read back into the RAM cache. An agent's long system prompt or
a long conversation is then reused after a restart instead of recomputed (minutes on a few CPU
cores). A file for another model, context per slot or KV type, or a damaged one, is skipped and
named in the log; files of states no longer kept are removed.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridmoe.engine import slot_files
from hybridmoe.models.kv_cache import KVSnapshot

log = logging.getLogger(__name__)

SUFFIX = ".hmprompt"


@dataclass
class Kept:
    """One state to keep: its tokens, whole snapshot, checkpoints and when it was last used."""

    tokens: list[int]
    snapshot: KVSnapshot
    checkpoints: list[KVSnapshot]
    last_used: float

    @property
    def nbytes(self) -> int:
        return self.snapshot.nbytes + sum(c.nbytes for c in self.checkpoints)


def file_name(tokens: list[int]) -> str:
    """Named by its tokens: the same conversation saved again replaces its file."""
    return hashlib.sha256(repr(tokens).encode()).hexdigest()[:24] + SUFFIX


def choose(states: list[Kept], limit: int | None) -> list[Kept]:
    """Newest first within `limit` bytes, leaving out a state that another one holds as its prefix
    (the longer state serves every prompt the shorter one would)."""
    newest = sorted(states, key=lambda s: -s.last_used)
    whole = [s for i, s in enumerate(newest)
             if not any(len(o.tokens) >= len(s.tokens) and o.tokens[: len(s.tokens)] == s.tokens
                        and (len(o.tokens) > len(s.tokens) or j < i) for j, o in enumerate(newest) if j != i)]
    out: list[Kept] = []
    total = 0
    for s in whole:
        if limit is None or total + s.nbytes <= limit:
            out.append(s)
            total += s.nbytes
    return out


def save(directory: str, identity: dict[str, Any], states: list[Kept], limit: int | None) -> tuple[int, int]:
    """Write the chosen states and remove the directory's other prompt files; (files, bytes)."""
    os.makedirs(directory, exist_ok=True)
    kept, written = set(), 0
    for s in choose(states, limit):
        name = file_name(s.tokens)
        written += slot_files.save(os.path.join(directory, name), identity,
                                   slot_files.SlotState(s.tokens, s.snapshot, s.checkpoints))
        kept.add(name)
    for name in os.listdir(directory):
        if name.endswith(SUFFIX) and name not in kept:
            os.remove(os.path.join(directory, name))
    return len(kept), written


def load(directory: str, identity: dict[str, Any],
         check: Callable[[KVSnapshot], tuple[KVSnapshot, int]]) -> list[Kept]:
    """The directory's states that fit this server (`check` raises ValueError otherwise), oldest
    first; the others are named in the log and left alone."""
    if not os.path.isdir(directory):
        return []
    paths = [os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(SUFFIX)]
    out: list[Kept] = []
    for path in sorted(paths, key=os.path.getmtime):
        try:
            state, _ = slot_files.load(path, identity)
            if not state.snapshot.has_full_layers:
                raise slot_files.SlotFileError("the state has no full layers")
            check(state.snapshot)
            for c in state.checkpoints:
                check(c)
        except (slot_files.SlotFileError, ValueError, OSError) as e:
            log.warning("prompt cache: skipping %s: %s", path, e)
            continue
        out.append(Kept(state.tokens, state.snapshot, state.checkpoints, os.path.getmtime(path)))
    return out
