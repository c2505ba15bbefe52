"""`serve --responses-dir DIR`: stored Responses written to files as well as kept in memory.

Replicas behind a gateway do not choose which of them gets a conversation's next turn, so a
`previous_response_id` made on one replica must be readable by the others (docs/scale-out.md):
replicas that share DIR continue each other's conversations, and a restarted server keeps them.
One JSON file per response (its own items and its parent's id), written whole under a temporary
name and renamed, so a reader never sees half a file; the oldest files are deleted past a bound.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

_ID = re.compile(r"[A-Za-z0-9_-]{1,200}")  # our ids are resp_<hex>; anything else never names a file


class ResponseFiles:
    """The directory's files; safe for several processes (atomic renames, no index file)."""

    MAX_FILES = 16384  # across every process sharing the directory
    PRUNE_EVERY = 256  # writes between two scans for files past MAX_FILES

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._writes = 0

    def _path(self, rid: str) -> Path | None:
        return self.dir / f"{rid}.json" if _ID.fullmatch(rid) else None

    def write(self, rid: str, inputs: list[dict[str, Any]], outputs: list[dict[str, Any]],
              previous: str | None) -> None:
        path = self._path(rid)
        if path is None:
            return
        data = json.dumps({"input": inputs, "output": outputs, "previous": previous}, ensure_ascii=False)
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._writes += 1
        if self._writes % self.PRUNE_EVERY == 0:
            self.prune()

    def read(self, rid: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str | None] | None:
        """(input items, output items, parent id), or None when no readable file has that id."""
        path = self._path(rid)
        if path is None:
            return None
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
            return list(d["input"]), list(d["output"]), d.get("previous")
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def prune(self) -> None:
        """Delete the oldest files past MAX_FILES (another process may be deleting too)."""
        files = []
        for p in self.dir.glob("resp*.json"):
            try:
                files.append((p.stat().st_mtime, p))
            except OSError:
                continue
        if len(files) <= self.MAX_FILES:
            return
        files.sort()
        for _, p in files[:len(files) - self.MAX_FILES]:
            p.unlink(missing_ok=True)
