"""The embedded demo model (src/hybridmoe/data/demo.gguf, built by demo/): the engine against
transformers on the same weights, on held-out text, plus the file's tokenizer and chat behaviour.

transformers' GptOssForCausalLM is rebuilt from the GGUF itself (every tensor dequantized, gate/up
re-interleaved), so the comparison needs nothing from demo/work/.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridmoe.convert import gguf_to_hf_state
from hybridmoe.gguf.reader import open_model
from hybridmoe.quant.formats import dequantize
from hybridmoe.settings import ComputeSettings
from hybridmoe.tokenizer.chat_template import render_chat
from hybridmoe.tokenizer.tokenizer import Tokenizer

DEMO = Path(__file__).resolve().parent.parent / "src" / "hybridmoe" / "data" / "demo.gguf"
DATA = Path(__file__).resolve().parent / "data"
DEMO_DIR = Path(__file__).resolve().parent.parent / "demo"
WINDOW = 512  # the training sequence length

pytestmark = pytest.mark.skipif(not DEMO.exists(), reason="demo.gguf not built yet (see demo/README.md)")


def _llm_class():
    try:
        from hybridmoe.engine.llm import LLM
    except ImportError as e:  # pragma: no cover - only while the engine is missing
        pytest.skip(f"hybridmoe.engine.llm is not importable: {e}")
    return LLM


# ---------------------------------------------------------------- GGUF -> transformers


def _tensor(mf, name: str) -> torch.Tensor:
    info = mf.tensors[name]
    arr = mf.array(name) if info.ggml_type.name in ("F32", "F16") else dequantize(mf.raw(name), info.ggml_type)
    return torch.from_numpy(np.array(arr, dtype=np.float32).reshape(info.shape))


def hf_from_gguf(path: Path):
    """A transformers GptOssForCausalLM holding exactly the (dequantized) weights of the GGUF."""
    from transformers import GptOssConfig, GptOssForCausalLM

    mf = open_model(path)
    m, a = mf.metadata, "gpt-oss"
    n_layers = m[f"{a}.block_count"]
    cfg = GptOssConfig(
        vocab_size=len(m["tokenizer.ggml.tokens"]), hidden_size=m[f"{a}.embedding_length"],
        intermediate_size=m[f"{a}.expert_feed_forward_length"], num_hidden_layers=n_layers,
        num_attention_heads=m[f"{a}.attention.head_count"], num_key_value_heads=m[f"{a}.attention.head_count_kv"],
        head_dim=m[f"{a}.attention.key_length"], num_local_experts=m[f"{a}.expert_count"],
        num_experts_per_tok=m[f"{a}.expert_used_count"], sliding_window=m[f"{a}.attention.sliding_window"],
        max_position_embeddings=m[f"{a}.context_length"], rms_norm_eps=m[f"{a}.attention.layer_norm_rms_epsilon"],
        rope_parameters={"rope_type": "yarn", "rope_theta": m[f"{a}.rope.freq_base"],
                         "factor": m[f"{a}.rope.scaling.factor"],
                         "original_max_position_embeddings": m[f"{a}.rope.scaling.original_context_length"],
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
        tie_word_embeddings=False,
    )
    t = lambda name: _tensor(mf, name)  # noqa: E731
    sd = gguf_to_hf_state(t, n_layers)
    model = GptOssForCausalLM._from_config(cfg, attn_implementation="eager")
    model.load_state_dict(sd, strict=True)
    return model.eval()


def mean_nll(logits: np.ndarray, ids: list[int]) -> float:
    """Mean next-token negative log-likelihood of ids[1:] under logits[:-1] (float64)."""
    x = logits[:-1].astype(np.float64)
    lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    return float((lse - x[np.arange(len(x)), ids[1:]]).mean())


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def meta():
    return open_model(DEMO).metadata


@pytest.fixture(scope="module")
def heldout_ids(meta):
    tok = Tokenizer.from_metadata(meta)
    return tok.encode((DATA / "demo_heldout.txt").read_text("utf-8"))


@pytest.fixture(scope="module")
def llm():
    return _llm_class()(DEMO, compute=ComputeSettings(threads=2))


# ---------------------------------------------------------------- tests


def test_file_is_small_and_quantized_as_documented():
    assert DEMO.stat().st_size <= 12 * 1024 * 1024
    mf = open_model(DEMO)
    types = {name: info.ggml_type.name for name, info in mf.tensors.items()}
    assert {types[n] for n in types if "_exps.weight" in n} == {"MXFP4"}
    assert types["token_embd.weight"] == types["output.weight"] == "BF16"
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"


def test_tokenizer_matches_the_trained_one(meta, heldout_ids):
    # demo_heldout_ids.json was written by demo/export.py with the `tokenizers` object used for training.
    expected = json.loads((DATA / "demo_heldout_ids.json").read_text())
    assert heldout_ids == expected
    assert meta["tokenizer.ggml.pre"] == "gpt-4o"
    tok = Tokenizer.from_metadata(meta)
    assert tok.eos_id == tok.token_id("<|return|>")
    for name in ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>"):
        assert tok.is_special(tok.token_id(name)), name


def test_engine_loss_matches_transformers_on_heldout_text(llm, heldout_ids):
    hf = hf_from_gguf(DEMO)
    n = (len(heldout_ids) // WINDOW) * WINDOW
    assert n >= 2 * WINDOW, "held-out sample too short"
    ours, ref = [], []
    for s in range(0, n, WINDOW):
        ids = heldout_ids[s:s + WINDOW]
        ours.append(mean_nll(llm.logits(ids), ids))
        with torch.no_grad():
            ref.append(mean_nll(hf(torch.tensor([ids])).logits[0].float().numpy(), ids))
    ours_loss, ref_loss = float(np.mean(ours)), float(np.mean(ref))
    assert abs(ours_loss - ref_loss) <= 1e-3 * ref_loss, (ours_loss, ref_loss)
    # A trained model, not random weights: far below log(vocab) = 8.3 nats.
    assert ref_loss < 6.0, ref_loss


def test_chat_format_is_learned(llm, meta):
    """After the template's generation prompt the model opens a final-channel message, and a finished
    answer is closed with <|return|> (a stop token), not <|end|>: chat replies end by themselves."""
    tok = llm.tokenizer
    # reasoning_effort low: the corpus never puts analysis-channel reasoning before a low-effort answer
    prompt = render_chat(meta["tokenizer.chat_template"], [{"role": "user", "content": "What is a lawyer?"}],
                         add_generation_prompt=True,
                         extra_vars={"current_date": "2026-01-01", "reasoning_effort": "low"})
    header = "<|channel|>final<|message|>"
    answer = "One skilled in circumvention of the law."
    p_ids, h_ids, a_ids = tok.encode(prompt), tok.encode(header), tok.encode(answer, allow_special=False)
    ids = p_ids + h_ids + a_ids
    logits = llm.logits(ids)
    predicted = logits.argmax(-1)
    # positions len(p)-1 .. len(p)+len(h)-2 predict the header tokens
    assert predicted[len(p_ids) - 1:len(p_ids) + len(h_ids) - 1].tolist() == h_ids
    last = logits[-1].astype(np.float64)
    probs = np.exp(last - last.max())
    probs /= probs.sum()
    ret, end = tok.token_id("<|return|>"), tok.token_id("<|end|>")
    # v2 answers run 1-3 sentences, so after one sentence going on is likely too; never with <|end|>
    assert probs[ret] > 0.1 and probs[ret] > 10 * probs[end], (probs[ret], probs[end])


# ---------------------------------------------------------------- training format == serving format


@pytest.fixture(scope="module")
def chat_format():
    """demo/chat_format.py, the module that renders every chat example of the training corpus."""
    sys.path.insert(0, str(DEMO_DIR))
    try:
        import chat_format as module
    finally:
        sys.path.remove(str(DEMO_DIR))
    return module


def test_training_prompts_are_what_the_server_renders(chat_format, meta):
    """A tool conversation rendered as demo/corpus.py renders it and as the server renders the same
    request (ChatRenderer on the GGUF's own template) gives the same tokens."""
    from hybridmoe.server.chat_checks import RenderPlan
    from hybridmoe.server.chat_render import ChatRenderer
    from hybridmoe.server.protocol import ChatMessage, Tool
    from hybridmoe.tokenizer.formats import choose_format

    assert meta["tokenizer.chat_template"] == chat_format.TEMPLATE
    tok = Tokenizer.from_metadata(meta)
    args = {"book": "Ruth", "chapter": 1, "verse": 16}
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "What does Ruth 1:16 say?"},
                chat_format.call_message("lookup_verse", args),
                {"role": "tool", "tool_call_id": "call_0", "content": "Ruth said, Don't urge me to leave you."}]
    tools = [chat_format.LOOKUP_VERSE_TOOL]
    ours = chat_format.render_prompt(messages, tools, "high", "2026-01-01")
    template = meta["tokenizer.chat_template"]
    renderer = ChatRenderer(template, tok, {"current_date": "2026-01-01"}, "auto", choose_format(template, tok))
    served = renderer.render([ChatMessage.model_validate(m) for m in messages],
                             [Tool.model_validate(t) for t in tools], "high", None, RenderPlan(True, False)).prompt
    assert tok.encode(ours) == tok.encode(served)
    # the model's call, as generated after the first user turn, is the re-rendered history verbatim
    first = chat_format.render_prompt(messages[:2], tools, "high", "2026-01-01")
    assert ours.startswith(first + chat_format.tool_call_reply("lookup_verse", args))


def test_tool_call_format_is_learned(llm, meta, chat_format):
    """With lookup_verse offered, a verse question is not answered directly (the final channel is
    unlikely; the model reasons first or calls at once), the commentary channel continues as the
    tool-call header (teacher forced, argmax at every header token) and the call's JSON is closed
    with <|call|>."""
    tok = llm.tokenizer
    prompt = chat_format.render_prompt([{"role": "user", "content": "What does Ruth 1:16 say?"}],
                                       [chat_format.LOOKUP_VERSE_TOOL], "low", "2026-01-01")
    p_ids = tok.encode(prompt)
    first = llm.logits(p_ids + [tok.token_id("<|channel|>")])[-1].astype(np.float64)
    probs = np.exp(first - first.max())
    probs /= probs.sum()
    assert probs[tok.encode("final", allow_special=False)[0]] < 0.05
    header = "<|channel|>commentary to=functions.lookup_verse <|constrain|>json<|message|>"
    h_ids = tok.encode(header)
    forced = next(k for k in range(1, len(h_ids)) if tok.decode(h_ids[:k]).endswith("commentary"))
    args = '{"book":"Ruth","chapter":1,"verse":16}'
    a_ids = tok.encode(args, allow_special=False)
    predicted = llm.logits(p_ids + h_ids + a_ids).argmax(-1)
    assert predicted[len(p_ids) + forced - 1:len(p_ids) + len(h_ids) - 1].tolist() == h_ids[forced:]
    assert int(predicted[-1]) == tok.token_id("<|call|>")
