"""`serve --spec-type ngram-simple` on the bundled demo model, no seams: a reply that repeats
itself is drafted from its own history, and what comes back is what plain decoding writes."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridmoe import LLM, ComputeSettings
from tests.server.conftest import ServerProcess, start_server, stop_server

DEMO = Path(__file__).resolve().parents[2] / "src" / "hybridmoe" / "data" / "demo.gguf"
PROMPT = "def add(a, b):\n    return a + b\n\n" * 3

pytestmark = pytest.mark.skipif(not DEMO.exists(), reason="demo.gguf not built yet (see demo/README.md)")


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("spec") / "server.log"
    srv = start_server(str(DEMO), ["--spec-type", "ngram-simple", "--metrics", "-np", "2", "-t", "1"], log, None)
    yield srv
    stop_server(srv)


def test_drafted_reply_is_plain_decodings(spec_server):
    status, body = spec_server.request("POST", "/completion", {"prompt": PROMPT, "n_predict": 150,
                                                               "temperature": 0, "cache_prompt": False})
    assert status == 200, body
    plain = LLM(DEMO, compute=ComputeSettings(threads=1)).generate(PROMPT, max_tokens=150, temperature=0.0)
    assert body["content"] == plain.text
    t = body["timings"]
    assert t["draft_n"] > 0 and 0 < t["draft_n_accepted"] <= t["draft_n"]
    _, metrics = spec_server.request("GET", "/metrics")
    values = dict(re.findall(r"^llamacpp:(\w+) (\S+)$", metrics, re.M))
    assert float(values["spec_decode_num_accepted_tokens_total"]) >= t["draft_n_accepted"]
    assert float(values["spec_decode_num_drafts_total"]) > 0
    _, slots = spec_server.request("GET", "/slots")
    assert all(s["speculative"] is True for s in slots)
