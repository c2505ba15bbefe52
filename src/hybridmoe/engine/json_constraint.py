"""JSON mode for the sampler: which tokens may come next so that sampling only ever extends a
JSON text the request admits (`response_format` json_object: any JSON object; json_schema: what
the schema admits; both recognized byte by byte by json_schema.SchemaState).

Checking a candidate token is: copy the recognizer state (a few small frames), feed the token's
bytes, see whether it failed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from hybridmoe.engine.json_schema import object_state


class JsonConstraint:
    """Per-request JSON mode (with or without a schema) for the sampler: `allowed(token)` for candidates, `advance(token)`
    for the chosen one. End-of-generation tokens are allowed exactly when the object is complete;
    other special tokens never are."""

    def __init__(self, token_bytes: Callable[[int], bytes], end_ids: Iterable[int], special_ids: Iterable[int],
                 state: Any = None):
        """state: the recognizer (a json_schema.SchemaState); any JSON object by default."""
        self._bytes = token_bytes
        self.end_ids = frozenset(end_ids)
        self._special = frozenset(special_ids)
        self.state = object_state() if state is None else state

    @property
    def done(self) -> bool:
        return self.state.done

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
