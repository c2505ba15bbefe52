"""Long texts are encoded in pieces cut before a space that follows a non-space (where both
pre-tokenizer patterns always split): the ids must equal one whole-text encode, and a token
limit must refuse a text as soon as it is certainly over."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridmoe.engine.llm import DEMO_MODEL
from hybridmoe.gguf.reader import open_model
from hybridmoe.tokenizer.tokenizer import TokenLimitExceeded, Tokenizer, split_at_spaces

ALPHABET = st.sampled_from(list("ab Z9.,'\n\t\r-") + [" ", "  ", "'s", "'ll", "é", "中", "\u0301", "🙂",
                                                      "<|start|>", "<|message|>", "<|end|>", "123456"])
TEXTS = st.lists(ALPHABET, min_size=0, max_size=3000).map("".join)


@pytest.fixture(scope="module", params=["demo", "tiny", "tiny-gpt2-pattern"])
def tokenizer(request, tiny_gguf) -> Tokenizer:
    if request.param == "demo" and not DEMO_MODEL.is_file():
        pytest.skip("no bundled demo model in this checkout")
    meta = dict(open_model(str(DEMO_MODEL) if request.param == "demo" else tiny_gguf).metadata)
    if request.param == "tiny-gpt2-pattern":
        meta["tokenizer.ggml.pre"] = "default"
    return Tokenizer.from_metadata(meta)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(text=TEXTS, size=st.integers(1, 64))
def test_pieces_rejoin_and_start_at_a_space_after_a_non_space(text: str, size: int):
    pieces = split_at_spaces(text, size)
    assert "".join(pieces) == text
    for p in pieces[1:]:
        assert p[0] == " "
    for a in pieces[:-1]:
        assert not a[-1].isspace()


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(text=TEXTS.map(lambda t: t * 3), special=st.booleans())
def test_piecewise_encoding_equals_whole_text_encoding(tokenizer: Tokenizer, text: str, special: bool, monkeypatch):
    import hybridmoe.tokenizer.tokenizer as mod

    hf = tokenizer._hf if special else tokenizer._plain_tokenizer()
    whole = hf.encode(text, add_special_tokens=False).ids
    with monkeypatch.context() as m:
        m.setattr(mod, "_PIECE_CHARS", 97)  # many pieces per text, several batch calls
        m.setattr(mod, "_PIECES_PER_CALL", 3)
        assert tokenizer.encode(text, allow_special=special) == whole


def test_token_limit_refuses_early(tokenizer: Tokenizer):
    text = "hello world, " * 50_000
    with pytest.raises(TokenLimitExceeded) as e:
        tokenizer.encode(text, max_tokens=100)  # 650k chars: over by length alone
    assert e.value.limit == 100 and e.value.at_least > 100
    short = "hello world, " * 300
    n = len(tokenizer.encode(short))
    assert tokenizer.encode(short, max_tokens=n) == tokenizer.encode(short)
    with pytest.raises(TokenLimitExceeded):
        tokenizer.encode(short, max_tokens=n - 1)
