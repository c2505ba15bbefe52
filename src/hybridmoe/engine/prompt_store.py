"""The prompt cache across restarts (`serve --prompt-cache-dir DIR`).

The states worth keeping (each slot's, each RAM-cache entry's) are written to DIR as slot files
(engine/slot_files.py: model identity, SHA-256), newest first up to the RAM cache's limit, after
each quiet spell and at shutdown (a file already there for the same tokens is kept as it is); at
the next start they are read back into the RAM cache. An agent's long system prompt or
a long conversation is then reused after a restart instead of recomputed (minutes on a few CPU
cores). A file for another model, context per slot or KV type, or a damaged one, is skipped and
named in the log; files of states no longer kept are removed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridmoe.engine import slot_files
from hybridmoe.models.kv_cache import KVSnapshot

log = logging.getLogger(__name__)

SUFFIX = ".hmprompt"


@dataclass
class Kept:
    """One state to keep: its tokens, checkpoints, size and when it was last used, and its whole
    snapshot, or `take` to copy it only once it is to be written (a slot's live state: at most one
    such copy exists at a time; `take` gives None when the slot has moved on meanwhile)."""

    tokens: list[int]
    snapshot: KVSnapshot | None
    checkpoints: list[KVSnapshot]
    last_used: float
    state_bytes: int = 0  # the snapshot's size when it is taken later
    take: Callable[[], KVSnapshot | None] | None = None

    @property
    def nbytes(self) -> int:
        state = self.snapshot.nbytes if self.snapshot is not None else self.state_bytes
        return state + sum(c.nbytes for c in self.checkpoints)


def file_name(identity: dict[str, Any], tokens: list[int]) -> str:
    """Named by the server's identity and the tokens: the same state saved again is the same file,
    and one saved for another model, context or KV type never stands in for it."""
    return hashlib.sha256(repr((sorted(identity.items()), tokens)).encode()).hexdigest()[:24] + SUFFIX


def choose(states: list[Kept], limit: int | None) -> list[Kept]:
    """Newest first within `limit` bytes, leaving out a state that another one holds as its prefix
    (the longer state serves every prompt the shorter one would)."""
    newest = sorted(states, key=lambda s: -s.last_used)

    def held_elsewhere(i: int, s: Kept) -> bool:
        """Another state extends s's tokens, or holds the same ones and is newer."""
        n = len(s.tokens)
        return any(o.tokens[:n] == s.tokens and (len(o.tokens) > n or j < i) for j, o in enumerate(newest) if j != i)

    whole = [s for i, s in enumerate(newest) if not held_elsewhere(i, s)]
    out: list[Kept] = []
    total = 0
    for s in whole:
        if limit is None or total + s.nbytes <= limit:
            out.append(s)
            total += s.nbytes
    return out


def save(directory: str, identity: dict[str, Any], states: list[Kept], limit: int | None) -> tuple[int, int]:
    """Write the chosen states not on disk yet and remove the directory's other prompt files;
    (files kept, bytes written)."""
    os.makedirs(directory, exist_ok=True)
    kept, written = set(), 0
    for s in choose(states, limit):
        name = file_name(identity, s.tokens)
        path = os.path.join(directory, name)
        if os.path.exists(path):
            os.utime(path)  # its recency, for the order of the next load
        else:
            snap = s.snapshot if s.snapshot is not None else s.take() if s.take is not None else None
            if snap is None:
                continue  # the slot went on to another state: the next save has it
            written += slot_files.save(path, identity, slot_files.SavedSlot(s.tokens, snap, s.checkpoints))
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


class Keeper:
    """Keeps DIR current while the server runs: once the states have changed and no request has
    run for `idle_seconds`, and at shutdown (`close`). Writing happens off the engine thread; only
    the copying of the slots' states takes the engine's time, between steps."""

    def __init__(self, engine: Any, directory: str, idle_seconds: float = 10.0, poll_seconds: float = 2.0) -> None:
        self.engine, self.directory = engine, directory
        self.idle_seconds, self.poll_seconds = idle_seconds, poll_seconds
        self._saved_at = engine.states_changed
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hybridmoe-prompt-cache", daemon=True)

    def start(self) -> Keeper:
        self._thread.start()
        return self

    def save(self) -> tuple[int, int]:
        """Write what changed now; (files kept, bytes written)."""
        with self._lock:
            version = self.engine.states_changed
            out = self.engine.persistence.save_prompt_cache(self.directory)
            self._saved_at = version
            return out

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            if self.engine.states_changed == self._saved_at or self.engine.idle_seconds() < self.idle_seconds:
                continue
            try:
                n, nbytes = self.save()
                log.info("prompt cache: %d cached prompts kept in %s (%.0f MiB written)", n, self.directory,
                         nbytes / 2**20)
            except Exception as e:  # a full disk, a closed engine: the server goes on either way
                log.error("prompt cache not saved to %s: %s", self.directory, e)

    def close(self) -> None:
        """Stop the background writer (the caller saves once more after stopping the engine)."""
        self._stop.set()
        self._thread.join(timeout=60)
