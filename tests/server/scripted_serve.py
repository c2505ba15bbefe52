"""`hybridmoe serve` whose replies are scripted: the test seam for harmony output from a random model.

Run as `python tests/server/scripted_serve.py SCRIPT_FILE serve ARGS...`. SCRIPT_FILE holds a JSON
list of harmony texts; every request the engine accepts takes the first one (the file is rewritten
without it) and the engine emits its tokens instead of sampled ones (the model still runs each
step). With the list empty the model samples. Everything after the engine is the production path.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from pathlib import Path

from hybridmoe.engine import engine as engine_module
from hybridmoe.engine.engine import GenerationRequest, RequestHandle

_lock = threading.Lock()


def _next_script(path: Path) -> str | None:
    with _lock:
        scripts = json.loads(path.read_text() or "[]") if path.exists() else []
        if not scripts:
            return None
        path.write_text(json.dumps(scripts[1:]))
        return scripts[0]


def install(path: Path) -> None:
    submit = engine_module.Engine.submit

    def scripted_submit(self: engine_module.Engine, request: GenerationRequest,
                        loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        text = _next_script(path)
        if text is not None:
            request.forced_tokens = self.tokenizer.encode(text, allow_special=True)
        return submit(self, request, loop)

    engine_module.Engine.submit = scripted_submit  # type: ignore[method-assign]


def write_scripts(path: Path, scripts: list[str]) -> None:
    with _lock:
        path.write_text(json.dumps(scripts))


if __name__ == "__main__":
    install(Path(sys.argv[1]))
    from hybridmoe.cli import main

    sys.argv = ["hybridmoe", *sys.argv[2:]]
    sys.exit(main())
