"""The public Python API and the generate command on a tiny synthetic model."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from hybridmoe import LLM, ComputeSettings, ContextSettings
from hybridmoe.settings import SamplerSettings
from hybridmoe.gguf.writer import write_split
from hybridmoe.synth import PRESETS, synth_metadata, synth_tensors

TIMING_KEYS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms", "predicted_per_second"}


def test_generate_returns_text_ids_and_llama_server_timings(tiny_llm):
    res = tiny_llm.generate("Hello world", max_tokens=8, temperature=0.0, ignore_eos=True)
    assert len(res.token_ids) == 8 and res.finish_reason == "length"
    assert res.text == tiny_llm.detokenize(res.token_ids)
    assert set(res.timings) == TIMING_KEYS
    assert res.timings["prompt_n"] == len(tiny_llm.tokenize("Hello world"))
    assert res.timings["predicted_n"] == 8 and res.timings["predicted_ms"] > 0


def test_seeded_sampling_is_reproducible(tiny_llm):
    a = tiny_llm.generate("Once upon", max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
    b = tiny_llm.generate("Once upon", max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
    c = tiny_llm.generate("Once upon", max_tokens=12, temperature=1.0, seed=43, ignore_eos=True)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stops_on_end_of_generation_ids_not_end(tiny_llm):
    tok = tiny_llm.tokenizer
    ret, call, end = tok.token_id("<|return|>"), tok.token_id("<|call|>"), tok.token_id("<|end|>")
    assert {ret, call} <= set(tok.eog_ids) and end not in tok.eog_ids
    # Force <|return|> to be the greedy choice by biasing the output head's row for it.
    head = tiny_llm.model.output
    saved = head.bias
    import torch

    bias = torch.zeros(tiny_llm.config.vocab_size)
    bias[ret] = 1e4
    head.bias = bias
    try:
        res = tiny_llm.generate("Hi", max_tokens=10, temperature=0.0)
        assert res.token_ids == [] and res.finish_reason == "stop"
        # ignore_eos bans the end tokens (llama-server's rule), so the reply goes on as text
        res = tiny_llm.generate("Hi", max_tokens=3, temperature=0.0, ignore_eos=True)
        assert len(res.token_ids) == 3 and not set(res.token_ids) & set(tok.eog_ids) and res.finish_reason == "length"
        res = tiny_llm.generate("Hi", max_tokens=3, temperature=2.0, seed=1, ignore_eos=True)
        assert len(res.token_ids) == 3 and not set(res.token_ids) & set(tok.eog_ids)
    finally:
        head.bias = saved


def test_logit_bias_and_penalties_reach_the_sampler(tiny_llm):
    free = tiny_llm.generate("Hi there", max_tokens=6, temperature=0.0, ignore_eos=True)
    banned = tiny_llm.generate("Hi there", max_tokens=6, temperature=0.0, ignore_eos=True,
                               logit_bias={t: float("-inf") for t in free.token_ids})
    assert not set(banned.token_ids) & set(free.token_ids)
    once = tiny_llm.generate("Hi there", max_tokens=12, temperature=0.0, ignore_eos=True,
                             chain=SamplerSettings(frequency_penalty=1e4, repeat_last_n=-1))
    assert len(set(once.token_ids)) == 12 and not set(once.token_ids) & set(tiny_llm.tokenize("Hi there"))
    # DRY through the Python API (its breakers found on the caller's thread): no two-token run repeats
    dry = tiny_llm.generate("Hi there", max_tokens=30, temperature=0.0, ignore_eos=True,
                            chain=SamplerSettings(dry_multiplier=1000.0, dry_allowed_length=1))
    text = tiny_llm.tokenize("Hi there") + dry.token_ids
    pairs = list(zip(text, text[1:]))
    assert len(pairs) == len(set(pairs)), dry.token_ids


def test_tokenize_detokenize_round_trip(tiny_llm):
    text = "Héllo, wörld! 你好 🙂 <|start|>user"
    ids = tiny_llm.tokenize(text)
    assert tiny_llm.detokenize(ids) == text
    assert tiny_llm.tokenizer.token_id("<|start|>") in ids


def test_split_model_opens_from_first_part(tmp_path, tiny_llm):
    p = PRESETS["tiny"]
    base = tmp_path / "tiny.gguf"
    paths = write_split(base, synth_metadata(p, 0), synth_tensors(p, 0, sparse=False), max_shard_bytes=200_000)
    assert len(paths) >= 3
    first = next(x for x in paths if "00001-of" in str(x))
    split_llm = LLM(first, compute=ComputeSettings(threads=1))
    ids = tiny_llm.tokenize("split files load the same weights")
    np.testing.assert_array_equal(split_llm.logits(ids), tiny_llm.logits(ids))


def test_prompt_longer_than_context_is_rejected(tiny_gguf):
    llm = LLM(tiny_gguf, compute=ComputeSettings(threads=1), context=ContextSettings(ctx_size=8))
    with pytest.raises(ValueError, match="context"):
        llm.generate(list(range(8)), max_tokens=4)


def test_generate_command_prints_text_and_speeds(tiny_gguf):
    out = subprocess.run(
        [sys.executable, "-m", "hybridmoe.cli", "generate", "-m", tiny_gguf, "-p", "Hello", "-n", "5",
         "--temp", "0", "--ignore-eos", "-t", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Hello")
    assert "prompt" in out.stderr and "decode 5 tok" in out.stderr and "tok/s" in out.stderr


def test_generate_command_seed_is_reproducible(tiny_gguf, capsys):
    from hybridmoe.cli import main

    def run(seed: str) -> str:
        argv = ["generate", "-m", tiny_gguf, "-p", "Hi", "-n", "8", "--temp", "1.0", "--top-k", "0",
                "--top-p", "1", "--min-p", "0", "--seed", seed, "--ignore-eos", "-t", "1"]
        assert main(argv) == 0
        return capsys.readouterr().out

    a, b, c = run("5"), run("5"), run("6")
    assert a == b and a != c and a.startswith("Hi")


@pytest.mark.parametrize("argv,msg", [
    (["generate", "-m", "/nonexistent/model.gguf", "-n", "1"], "model.gguf"),
    (["synth", "--preset", "tiny", "--layers", "0", "--out", "/tmp/hm-never-written.gguf"], "--layers"),
])
def test_cli_errors_are_one_line_not_a_traceback(argv, msg):
    out = subprocess.run([sys.executable, "-m", "hybridmoe.cli", *argv], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    assert f"hybridmoe {argv[0]}: error:" in out.stderr and msg in out.stderr


def test_cli_rejects_a_non_gguf_file(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    out = subprocess.run([sys.executable, "-m", "hybridmoe.cli", "generate", "-m", str(bad), "-n", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr and "magic" in out.stderr.lower()


def test_fast_math_is_opt_in_and_close(tiny_gguf, tiny_llm):
    """--fast-math quantizes decode activations to int8 (llama.cpp's numerics); the default is exact."""
    from hybridmoe import kernels
    from hybridmoe.models.gpt_oss import SeqChunk

    if not kernels.available():
        pytest.skip("C kernels not built: fast mode is a kernel feature")

    def decode_rows(llm, ids):
        cache = llm.model.make_cache(len(ids))
        llm.model.forward([SeqChunk(cache, ids[:1])])
        return np.array([llm.model.forward([SeqChunk(cache, [t])])[0].numpy() for t in ids[1:]])

    ids = list(range(300, 340))
    exact = decode_rows(tiny_llm, ids)
    fast_llm = LLM(tiny_gguf, compute=ComputeSettings(threads=1, fast_math=True))
    fast = decode_rows(fast_llm, ids)
    assert np.array_equal(decode_rows(tiny_llm, ids), exact)  # a per-model setting: the first stays exact
    rows = np.abs(fast - exact).max(1) / np.abs(exact).max(1)
    assert np.isfinite(fast).all()
    assert 0 < np.median(rows) < 0.05, rows  # really the int8 path, and close (~1% measured)
    assert (fast.argmax(1) == exact.argmax(1)).mean() >= 0.9
