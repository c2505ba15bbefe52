"""Export the trained demo model to src/hybridmoe/data/demo.gguf and measure what quantization costs.

Experts -> MXFP4 (blocks of 32 along the input dim), attention/embedding/output matrices -> BF16,
norms, biases, sinks and the router -> F32 (through `hybridmoe.convert` and the project's GGUF
writer). The tokenizer (demo/work/tokenizer.json) and the project's harmony chat template go in the
metadata. Then the held-out loss is measured with transformers on (a) the float checkpoint, (b) the
float checkpoint with MXFP4 experts only, (c) exactly the exported weights; results are appended to
demo/work/export.json.

Run: python demo/export.py [--checkpoint demo/work/final | demo/work/ckpt.pt] [--val-windows 96]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import resources
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import GptOssForCausalLM

from hybridmoe.convert import gpt_oss_metadata, hf_to_gguf_tensors, mxfp4_roundtrip_experts, roundtrip
from hybridmoe.gguf.constants import GGMLType
from hybridmoe.gguf.writer import write_gguf
from hybridmoe.tokenizer.tokenizer import TOKEN_CONTROL, TOKEN_NORMAL

HERE = Path(__file__).resolve().parent
WORK = HERE / "work"
sys.path.insert(0, str(HERE))
from train import evaluate, load_tokens, model_config, val_windows  # noqa: E402

OUT = HERE.parent / "src" / "hybridmoe" / "data" / "demo.gguf"
DENSE_TYPE = GGMLType.BF16
DENSE_MATRICES = ("embed_tokens.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                  "lm_head.weight")


def tokenizer_metadata(tok: Tokenizer) -> dict:
    """tokenizer.ggml.* for a byte-level BPE trained by demo/tokenizer.py (vocab strings are already
    GPT-2 byte-to-unicode; the specials are stored as their plain text)."""
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [""] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    specials = {t["id"] for t in spec["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in spec["model"]["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-4o",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [TOKEN_CONTROL if i in specials else TOKEN_NORMAL for i in range(len(tokens))],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": tok.token_to_id("<|startoftext|>"),
        "tokenizer.ggml.eos_token_id": tok.token_to_id("<|return|>"),
        "tokenizer.ggml.padding_token_id": tok.token_to_id("<|endoftext|>"),
        "tokenizer.chat_template": resources.files("hybridmoe.data").joinpath("harmony_template.jinja").read_text(),
    }


def load_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    if checkpoint.is_dir():
        return GptOssForCausalLM.from_pretrained(checkpoint).state_dict()
    return torch.load(checkpoint, weights_only=False)["model"]


def exported_state(state: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """The float weights as the GGUF file holds them (MXFP4 experts, BF16 dense matrices)."""
    q = {k: v.clone() for k, v in state.items()}
    mxfp4_roundtrip_experts(q, n_layers)
    for k in q:
        if k.endswith(DENSE_MATRICES):
            q[k] = roundtrip(q[k], DENSE_TYPE)
    return q


def hf_model(state: dict[str, torch.Tensor], vocab_size: int) -> GptOssForCausalLM:
    m = GptOssForCausalLM._from_config(model_config(vocab_size), attn_implementation="eager")
    m.load_state_dict(state)
    return m.eval()


def write_test_sample(tok: Tokenizer, target_bytes: int = 6500) -> None:
    """tests/data/demo_heldout.txt: held-out documents (plain and chat) joined by <|endoftext|>, and
    the ids the training tokenizer gives them (tests/data/demo_heldout_ids.json)."""
    rows = [json.loads(line) for line in open(WORK / "corpus" / "val.jsonl")]
    picked, size = [], 0
    for src, kind in [("web", "text"), ("web", "tool"), ("devil", "chat"), ("tdavid", "chat"), ("pydoc", "text"),
                      ("mhcc", "chat"), ("devil", "text"), ("web", "chat"), ("tdavid", "text"),
                      ("pydoc", "chat"), ("mhcc", "text")]:
        doc = next((r["text"] for r in rows if r["src"] == src and r["kind"] == kind), None)
        if doc is None:
            continue
        picked.append(doc[:1500])
        size += len(doc.encode())
        if size >= target_bytes:
            break
    text = "<|endoftext|>".join(picked)
    data = HERE.parent / "tests" / "data"
    data.mkdir(exist_ok=True)
    (data / "demo_heldout.txt").write_text(text, "utf-8")
    (data / "demo_heldout_ids.json").write_text(json.dumps(tok.encode(text).ids))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=WORK / "final")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--val-windows", type=int, default=96, help="512-token held-out windows for the loss")
    ap.add_argument("--no-eval", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = Tokenizer.from_file(str(WORK / "tokenizer.json"))
    cfg = model_config(tok.get_vocab_size())
    write_test_sample(tok)
    state = load_state(args.checkpoint)
    t0 = time.time()
    meta = gpt_oss_metadata(cfg, tokenizer_metadata(tok), name="hybridmoe-demo")
    meta["general.description"] = ("Toy gpt-oss-architecture MoE trained by hybridmoe on public-domain and "
                                   "PSF-licensed text; writes English-looking text, reasons in the analysis channel and "
                                   "calls one demo tool (lookup_verse). See docs/demo-model.md.")
    specs = hf_to_gguf_tensors(state, cfg.num_hidden_layers, dense_type=DENSE_TYPE, expert_type=GGMLType.MXFP4)
    size = write_gguf(args.out, meta, specs)
    result = {"checkpoint": str(args.checkpoint), "out": str(args.out), "bytes": size,
              "export_s": round(time.time() - t0, 2)}
    print(f"wrote {args.out} ({size / 1e6:.2f} MB) in {result['export_s']} s", flush=True)
    if not args.no_eval:
        windows = val_windows(load_tokens("val", tok), 512, args.val_windows)
        q_experts = {k: v.clone() for k, v in state.items()}
        mxfp4_roundtrip_experts(q_experts, cfg.num_hidden_layers)
        result["val_tokens"] = int(windows[:, 1:].numel())
        for label, sd in (("float", state), ("mxfp4_experts", q_experts),
                          ("exported", exported_state(state, cfg.num_hidden_layers))):
            result[f"val_loss_{label}"] = round(evaluate(hf_model(sd, tok.get_vocab_size()), windows), 5)
            print(label, result[f"val_loss_{label}"], flush=True)
        result["mxfp4_cost_nats"] = round(result["val_loss_mxfp4_experts"] - result["val_loss_float"], 5)
        result["export_cost_nats"] = round(result["val_loss_exported"] - result["val_loss_float"], 5)
    with open(WORK / "export.json", "a") as f:
        f.write(json.dumps(result) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
