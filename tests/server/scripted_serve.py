"""Scripted replies: the test seam for harmony output from a random model (tests only).

A request with a script gets its tokens instead of sampled ones while the model still runs every
step: `ModelRunner.sample` is wrapped here, so no production type carries a forced output. The
scripted token is emitted as is (no grammar constraint is advanced by it) and gets its logprobs
like a sampled one; past the script's end the request samples normally. Everything after the
runner (stop handling, harmony parsing, the APIs) is the production path.

In-process: `scripted_sampling(monkeypatch)` and `script_request(request_id, ids)`.
As a server: `python tests/server/scripted_serve.py SCRIPT_FILE serve ARGS...`; SCRIPT_FILE holds
a JSON list of harmony texts and every request the engine accepts takes the first one (the file
is rewritten without it). With the list empty the model samples.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from hybridmoe.engine import engine as engine_module
from hybridmoe.engine.engine import GenerationRequest, RequestHandle
from hybridmoe.engine.request import SequenceState as EngineSequence
from hybridmoe.engine.runner import ModelRunner
from hybridmoe.engine.sampler import Sampler, TokenLogprobs

_lock = threading.Lock()
_scripts: dict[str, list[int]] = {}  # request_id -> token ids emitted in place of sampled ones

SampleFn = Callable[[ModelRunner, EngineSequence, torch.Tensor], "tuple[int, TokenLogprobs | None]"]


def script_request(request_id: str, token_ids: Sequence[int]) -> None:
    """The request `request_id` emits `token_ids` first (call before it is submitted)."""
    with _lock:
        _scripts[request_id] = [int(t) for t in token_ids]


def _scripted(sample: SampleFn) -> SampleFn:
    def scripted_sample(self: ModelRunner, seq: EngineSequence, row: torch.Tensor
                        ) -> tuple[int, TokenLogprobs | None]:
        req = seq.request
        with _lock:
            ids = _scripts.get(req.request_id)
            if ids is not None and seq.n_generated + 1 >= len(ids):
                del _scripts[req.request_id]  # its last scripted token: forget the script
        if ids is None or seq.n_generated >= len(ids):
            return sample(self, seq, row)
        token = ids[seq.n_generated]
        return token, (Sampler.logprobs(row, token, req.logprobs) if req.logprobs is not None else None)

    return scripted_sample


def scripted_sampling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wrap `ModelRunner.sample` for the test's duration (every engine of the process)."""
    monkeypatch.setattr(ModelRunner, "sample", _scripted(ModelRunner.sample))


def _next_script(path: Path) -> str | None:
    with _lock:
        scripts = json.loads(path.read_text() or "[]") if path.exists() else []
        if not scripts:
            return None
        path.write_text(json.dumps(scripts[1:]))
        return scripts[0]


def install(path: Path) -> None:
    """The server process's seam: each accepted request takes the next script of `path`."""
    submit = engine_module.Engine.submit

    def scripted_submit(self: engine_module.Engine, request: GenerationRequest,
                        loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        text = _next_script(path)
        if text is not None:
            script_request(request.request_id, self.tokenizer.encode(text, allow_special=True))
        return submit(self, request, loop)

    engine_module.Engine.submit = scripted_submit  # type: ignore[method-assign]
    ModelRunner.sample = _scripted(ModelRunner.sample)  # type: ignore[method-assign]


def write_scripts(path: Path, scripts: list[str]) -> None:
    with _lock:
        path.write_text(json.dumps(scripts))


def launcher(path: Path) -> list[str]:
    """The command that runs `serve ARGS` with replies scripted from `path` (conftest.start_server)."""
    return [sys.executable, str(Path(__file__)), str(path)]


if __name__ == "__main__":
    install(Path(sys.argv[1]))
    from hybridmoe.cli import main

    sys.argv = ["hybridmoe", *sys.argv[2:]]
    sys.exit(main())

