"""Stored Responses for `previous_response_id`: at most `ResponseStore.MAX_RESPONSES` responses and
`MAX_CHARS` characters of items in memory, the oldest dropped first; with --responses-dir each is
also written to a file (server/response_files.py), which replicas behind a gateway share and a
restart reads back."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from hybridmoe.server.protocol import APIError
from hybridmoe.server.response_files import ResponseFiles
from hybridmoe.server.responses_items import InputItem, parse_items


@dataclass
class _Stored:
    input: list[InputItem]  # this request's items (not its ancestors')
    output: list[InputItem]
    previous: str | None
    chars: int


class ResponseStore:
    """Bounded, in-memory `previous_response_id` history; a response links to its parent, so
    a long conversation costs its length once. With `files` (serve --responses-dir) every stored
    response is written there too, and an id missing from memory is read back from there."""

    MAX_RESPONSES = 1024
    MAX_CHARS = 64 * 1024 * 1024

    def __init__(self, files: ResponseFiles | None = None) -> None:
        self._entries: OrderedDict[str, _Stored] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self.files = files

    def put(self, rid: str, inputs: list[InputItem], outputs: list[dict[str, Any]], previous: str | None) -> None:
        self._remember(rid, inputs, parse_items(outputs, "output"), previous)
        if self.files is not None:
            self.files.write(rid, [i.model_dump(mode="json", exclude_none=True) for i in inputs], outputs, previous)

    def _remember(self, rid: str, inputs: list[InputItem], outputs: list[InputItem], previous: str | None) -> _Stored:
        chars = sum(len(i.model_dump_json()) for i in [*inputs, *outputs])
        entry = _Stored(inputs, outputs, previous, chars)
        with self._lock:
            self._entries[rid] = entry
            self._chars += chars
            while len(self._entries) > self.MAX_RESPONSES or self._chars > self.MAX_CHARS:
                _, old = self._entries.popitem(last=False)
                self._chars -= old.chars
        return entry

    def _get(self, rid: str) -> _Stored | None:
        with self._lock:
            entry = self._entries.get(rid)
        if entry is not None or self.files is None:
            return entry
        found = self.files.read(rid)  # another replica's response, or one from before a restart
        if found is None:
            return None
        try:
            return self._remember(rid, parse_items(found[0], "input"), parse_items(found[1], "output"), found[2])
        except ValueError:
            return None

    def history(self, rid: str) -> list[InputItem]:
        """Every item of the conversation that ended with response `rid`, oldest first."""
        chain: list[_Stored] = []
        cur: str | None = rid
        while cur is not None:
            entry = self._get(cur)
            if entry is None:
                which = "" if cur == rid else f" (its ancestor {cur} was dropped from the store)"
                where = "in memory and in --responses-dir" if self.files is not None else "in memory"
                raise APIError(400, f"Previous response with id '{rid}' not found{which}; this server keeps "
                               f"the last {self.MAX_RESPONSES} stored responses {where}",
                               param="previous_response_id", code="previous_response_not_found")
            chain.append(entry)
            cur = entry.previous
        return [item for entry in reversed(chain) for item in (*entry.input, *entry.output)]
