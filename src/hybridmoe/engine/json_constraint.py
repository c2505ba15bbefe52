"""JSON mode for the sampler: which tokens may come next so that sampling only ever extends a
JSON text the request admits (`response_format` json_object: any JSON object; json_schema: what
the schema admits; both recognized byte by byte by json_schema.SchemaState).

Checking a candidate token is: copy the recognizer state (a few small frames), feed the token's
bytes, see whether it failed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from hybridmoe.engine.json_schema import object_state


class FirstByteIndex:
    """Token ids grouped by their first byte (specials and empty tokens left out), built once per
    vocabulary: the sampler's fallback then checks only tokens whose first byte fits the state."""

    def __init__(self, token_bytes: Callable[[int], bytes], n_vocab: int, special_ids: Iterable[int]):
        special = frozenset(special_ids)
        first = np.array([256 if t in special or not (tb := token_bytes(t)) else tb[0] for t in range(n_vocab)])
        order = np.argsort(first, kind="stable")
        bounds = np.searchsorted(first[order], np.arange(258))
        self.groups = [torch.from_numpy(order[bounds[b]:bounds[b + 1]]) for b in range(256)]


class JsonConstraint:
    """Per-request JSON mode (with or without a schema) for the sampler: `allowed(token)` for
    candidates, `advance(token)` for the chosen one, `candidates()` for the fallback scan.
    End-of-generation tokens are allowed exactly when the text is complete; other special tokens
    never are."""

    def __init__(self, token_bytes: Callable[[int], bytes], end_ids: Iterable[int], special_ids: Iterable[int],
                 state: Any = None, index: FirstByteIndex | None = None):
        """state: the recognizer (a json_schema.SchemaState); any JSON object by default."""
        self._bytes = token_bytes
        self.end_ids = frozenset(end_ids)
        self._special = frozenset(special_ids)
        self.state = object_state() if state is None else state
        self._index = index

    @property
    def done(self) -> bool:
        return self.state.done

    def candidates(self) -> torch.Tensor | None:
        """Ids of the tokens whose first byte the state admits (a superset of the allowed ones,
        end tokens not included); None without an index."""
        if self._index is None:
            return None
        ok = [g for b, g in enumerate(self._index.groups) if len(g) and self.state.copy().feed(bytes([b]))]
        return torch.cat(ok) if ok else torch.zeros(0, dtype=torch.int64)
    def allowed(self, token: int) -> bool:
        if token in self.end_ids:
            return self.state.done
        if token in self._special:
            return False
        data = self._bytes(token)
        return bool(data) and self.state.copy().feed(data)

    def advance(self, token: int) -> None:
        if token in self.end_ids:
            return
        if not self.state.feed(self._bytes(token)):
            raise ValueError(f"token {token} does not continue the JSON text")
