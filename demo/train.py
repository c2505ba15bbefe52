"""Train the demo model: transformers' GptOssForCausalLM on the CPU, on a time budget.

Architecture (gpt-oss in miniature): hidden 256, 4 layers alternating sliding window 128 / full
attention, 4 query heads x head_dim 64, 2 KV heads, attention sinks, 8 experts top-2 with
intermediate 256, YaRN RoPE exactly as gpt-oss (factor 32, original 4096, beta 32/1, no truncate).

The learning rate follows a *time-based* schedule (linear warm-up, then cosine to 10% of the peak at
--minutes), so the run ends on time whatever the machine's load. A checkpoint (model + optimizer) is
written to demo/work/ckpt.pt every --ckpt-minutes and at the end; --resume continues one. Progress
goes to demo/work/train_log.jsonl; the final model is saved with save_pretrained to demo/work/final/.

--init-gguf warm-starts from a demo GGUF (weights dequantized, tokenizer rebuilt with identical ids;
demo/from_gguf.py) instead of random weights and demo/tokenizer.py's BPE.

Run:  OMP_NUM_THREADS=2 nohup python demo/train.py --init-gguf src/hybridmoe/data/demo.gguf --lr 1e-3 &
      OMP_NUM_THREADS=2 nohup python demo/train.py --minutes 60 &     # from scratch (after tokenizer.py)
      python demo/train.py --bench 60      # measure tokens/s only
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import GptOssConfig, GptOssForCausalLM

HERE = Path(__file__).resolve().parent
WORK = HERE / "work"
sys.path.insert(0, str(HERE))
EOT = "<|endoftext|>"  # separates packed documents


def model_config(vocab_size: int) -> GptOssConfig:
    return GptOssConfig(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_local_experts=8, num_experts_per_tok=2, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=4096,  # trained at 512; 4096 is YaRN's original length
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
        router_aux_loss_coef=0.01, output_router_logits=True, tie_word_embeddings=False,
        bos_token_id=0, pad_token_id=1, eos_token_id=2, use_cache=False,
    )


def load_tokens(split: str, tok: Tokenizer) -> np.ndarray:
    """The split as one uint16 stream of documents joined by <|endoftext|> (cached as .npy)."""
    cache = WORK / f"tokens_{split}.npy"
    src = WORK / "corpus" / f"{split}.jsonl"
    newest = max((WORK / "tokenizer.json").stat().st_mtime, src.stat().st_mtime)
    if cache.exists() and cache.stat().st_mtime > newest:
        return np.load(cache)
    arr = encode_jsonl(src, tok)
    np.save(cache, arr)
    return arr


def encode_jsonl(path: Path, tok: Tokenizer) -> np.ndarray:
    texts = [json.loads(line)["text"] for line in open(path)]
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids += enc.ids
        ids.append(eot)
    return np.asarray(ids, dtype=np.uint16)


def loss_mask(ids: np.ndarray, tok: Tokenizer) -> np.ndarray:
    """False at each <|end|> that closes an assistant final or commentary message (a past turn of a
    multi-turn chat, a tool's output), and at that message's channel name: the model sees them in
    context but is never trained to emit them, so answers end in <|return|> and tool calls in
    <|call|>. The <|end|> after analysis-channel reasoning stays trained: the model must close its
    reasoning before the final answer.
    The channel is the text right after <|channel|>; <|start|> opens a new header."""
    start, channel, end, message = (tok.token_to_id(s)
                                    for s in ("<|start|>", "<|channel|>", "<|end|>", "<|message|>"))
    mask = np.ones(len(ids), dtype=bool)
    masking = False
    opened = -1
    for i in np.flatnonzero((ids == start) | (ids == channel) | (ids == end)).tolist():
        t = ids[i]
        if t == start:
            masking = False
        elif t == channel:
            masking = not tok.decode(ids[i + 1:i + 4].tolist(), skip_special_tokens=False).startswith("analysis")
            opened = i
        elif masking:
            mask[i] = False
            # Nor its channel name: the template drops a past turn's reasoning, so a past turn opens
            # `final` where the live turn would reason; trained, it teaches "no analysis" after a question.
            mask[opened + 1:ids[opened:i].tolist().index(message) + opened + 1] = False
    return mask


def focus_mask(ids: np.ndarray, tok: Tokenizer) -> np.ndarray:
    """True on the tokens that decide the acceptance checks: what a verse lookup copies from its
    context (a tool call's JSON arguments, a final answer after a tool's output) and the channel an
    assistant message opens (analysis, final or a call: the reasoning-effort decision). They get
    --focus-weight in the loss and are the tokens of the accuracy logged at each evaluation."""
    specials = {s: tok.token_to_id(s) for s in ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>",
                                                  "<|call|>", "<|return|>", "<|end|>", EOT)}
    start, channel, message, constrain = (specials[s] for s in ("<|start|>", "<|channel|>", "<|message|>",
                                                                 "<|constrain|>"))
    mask = np.zeros(len(ids), dtype=bool)
    tool_seen = is_call = is_final = is_assistant = False
    open_at = name_at = -1
    for i in np.flatnonzero(np.isin(ids, list(specials.values()))).tolist():
        t = ids[i]
        if name_at >= 0:  # an assistant's channel name ends at the next special token
            mask[name_at:i] = True
            name_at = -1
        if t == start:
            head = tok.decode(ids[i + 1:i + 4].tolist(), skip_special_tokens=False)
            if head.startswith("functions."):
                tool_seen = True
            elif head.startswith("user"):
                tool_seen = False
            is_assistant = head.startswith("assistant")
            is_call = is_final = False
        elif t == channel:
            is_final = tok.decode(ids[i + 1:i + 3].tolist(), skip_special_tokens=False).startswith("final")
            name_at = i + 1 if is_assistant else -1
        elif t == constrain:
            is_call = True
        elif t == message:
            open_at = i + 1 if is_call or (is_final and tool_seen) else -1
        else:  # a message ends (or the document does)
            if open_at >= 0:
                mask[open_at:i + 1] = True
            open_at = -1
            if t == specials[EOT]:
                tool_seen = False
    return mask


def val_windows(val: np.ndarray, seq: int, max_windows: int) -> torch.Tensor:
    n = min(max_windows, (len(val) - 1) // seq)
    step = (len(val) - 1) // n
    return torch.stack([torch.from_numpy(val[i * step:i * step + seq].astype(np.int64)) for i in range(n)])


@torch.no_grad()
def evaluate(model: GptOssForCausalLM, windows: torch.Tensor, batch: int = 8) -> float:
    """Mean next-token cross entropy (nats) over the windows, without the router aux loss."""
    return evaluate_focus(model, windows, None, batch)[0]


@torch.no_grad()
def evaluate_focus(model: GptOssForCausalLM, windows: torch.Tensor, focus: torch.Tensor | None,
                  batch: int = 8) -> tuple[float, float]:
    """(mean cross entropy, top-1 accuracy on the focus-masked target tokens; nan without a mask)."""
    model.eval()
    total, count, hits, copies = 0.0, 0, 0, 0
    for i in range(0, len(windows), batch):
        x = windows[i:i + batch]
        logits = model(input_ids=x).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                 reduction="sum")
        total += loss.item()
        count += x[:, 1:].numel()
        if focus is not None:
            m = focus[i:i + batch, 1:]
            hits += int(((logits.argmax(-1) == x[:, 1:]) & m).sum())
            copies += int(m.sum())
    model.train()
    return total / count, (hits / copies if copies else float("nan"))


def lr_at(frac: float, step: int, peak: float, warmup_steps: int) -> float:
    """Linear warm-up over steps, then cosine over the elapsed fraction of the time budget."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        # matrices and expert tensors decay; norms, biases, sinks do not
        (decay if p.dim() >= 2 and "bias" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def log(entry: dict) -> None:
    print(json.dumps(entry), flush=True)
    with open(WORK / "train_log.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--bench", type=float, default=0.0, help="only measure tokens/s for this many seconds")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup-steps", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--ckpt-minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=20261202)
    ap.add_argument("--focus-weight", "--copy-weight", type=float, default=1.0,
                    help="loss weight of focus_mask's tokens (copied tool arguments and verse, channel choice)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--init-gguf", type=Path, default=None,
                    help="warm start: weights and tokenizer from a demo GGUF (the tokenizer is written to "
                         "demo/work/tokenizer.json, so token ids match the file)")
    ap.add_argument("--init-check", type=Path, default=None,
                    help="with --init-gguf: a corpus .jsonl whose held-out loss is logged before training")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.init_gguf and not args.resume:
        from from_gguf import tokenizer_from_gguf

        tokenizer_from_gguf(args.init_gguf).save(str(WORK / "tokenizer.json"))
    tok = Tokenizer.from_file(str(WORK / "tokenizer.json"))
    train, val = load_tokens("train", tok), load_tokens("val", tok)
    train_mask = torch.from_numpy(loss_mask(train, tok))
    train_focus = torch.from_numpy(focus_mask(train, tok))
    windows = val_windows(val, args.seq, 48)
    val_focus = val_windows(focus_mask(val, tok), args.seq, 48).bool()
    model = GptOssForCausalLM._from_config(model_config(tok.get_vocab_size()), attn_implementation="eager")
    if args.init_gguf and not args.resume:
        from from_gguf import hf_state_from_gguf

        model.load_state_dict(hf_state_from_gguf(args.init_gguf, model.config.num_hidden_layers))
        if args.init_check:
            check = val_windows(encode_jsonl(args.init_check, tok), args.seq, 48)
            log({"event": "init", "gguf": str(args.init_gguf), "check_corpus": str(args.init_check),
                 "check_loss": round(evaluate(model, check), 4), "val_loss": round(evaluate(model, windows), 4),
                 "focus_acc": round(evaluate_focus(model, windows, val_focus)[1], 4)})
    model.train()
    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed)
    step, elapsed0, tokens_seen = 0, 0.0, 0
    if args.resume:
        ck = torch.load(WORK / "ckpt.pt", weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        gen.set_state(ck["gen"])
        step, elapsed0, tokens_seen = ck["step"], ck["elapsed"], ck["tokens"]
    budget = (args.bench or args.minutes * 60.0)
    n_params = sum(p.numel() for p in model.parameters())
    if not args.bench:
        log({"event": "start", "seed": args.seed, "params": n_params, "train_tokens": int(len(train)),
             "masked_end_tokens": int((~train_mask).sum()), "val_tokens": int(len(val)), "val_eval_tokens": int(windows.numel()), "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
             "torch": torch.__version__, "resume_step": step})
    t0 = time.time() - elapsed0
    last_ckpt = time.time()
    seq, batch = args.seq, args.batch
    bench_start = None
    first_step = step
    while True:
        elapsed = time.time() - t0
        if elapsed >= budget:
            break
        lr = lr_at(elapsed / budget, step, args.lr, args.warmup_steps)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(train) - seq - 1, (batch,), generator=gen)
        x = torch.stack([torch.from_numpy(train[s:s + seq].astype(np.int64)) for s in starts.tolist()])
        keep = torch.stack([train_mask[s:s + seq] for s in starts.tolist()])
        focus = torch.stack([train_focus[s:s + seq] for s in starts.tolist()])
        out = model(input_ids=x)
        ce = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]).float(),
                                               x[:, 1:].reshape(-1), reduction="none")
        weight = keep[:, 1:].float() * (1.0 + (args.focus_weight - 1.0) * focus[:, 1:].float())
        loss = (ce * weight.reshape(-1)).sum() / weight.sum() + model.config.router_aux_loss_coef * out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += x.numel()
        if bench_start is None and step >= first_step + 2:  # skip warm-up steps in the rate
            bench_start = (time.time(), tokens_seen)
        if step % 25 == 0:
            ce = loss.item() - model.config.router_aux_loss_coef * out.aux_loss.item()
            rate = (tokens_seen - bench_start[1]) / (time.time() - bench_start[0]) if bench_start else 0.0
            entry = {"step": step, "min": round((time.time() - t0) / 60, 2), "tokens": tokens_seen,
                     "loss": round(ce, 4), "aux": round(out.aux_loss.item(), 4), "lr": round(lr, 6),
                     "gnorm": round(float(gnorm), 3), "tok_s": round(rate)}
            if args.bench:
                print(json.dumps(entry), flush=True)
            else:
                log(entry)
        if not args.bench and time.time() - last_ckpt >= args.ckpt_minutes * 60:
            save_checkpoint(model, opt, gen, step, time.time() - t0, tokens_seen)
            val_loss, focus_acc = evaluate_focus(model, windows, val_focus)
            log({"event": "eval", "step": step, "min": round((time.time() - t0) / 60, 2), "tokens": tokens_seen,
                 "val_loss": round(val_loss, 4), "focus_acc": round(focus_acc, 4)})
            last_ckpt = time.time()
    if args.bench:
        rate = (tokens_seen - bench_start[1]) / (time.time() - bench_start[0])
        print(f"threads={args.threads} steps={step} tokens/s={rate:.0f}")
        return
    save_checkpoint(model, opt, gen, step, time.time() - t0, tokens_seen)
    val_loss, focus_acc = evaluate_focus(model, windows, val_focus)
    model.save_pretrained(WORK / "final")
    log({"event": "end", "step": step, "min": round((time.time() - t0) / 60, 2), "tokens": tokens_seen,
         "val_loss": round(val_loss, 4), "focus_acc": round(focus_acc, 4), "seed": args.seed})


def save_checkpoint(model, opt, gen, step: int, elapsed: float, tokens: int) -> None:
    tmp = WORK / "ckpt.pt.tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), "step": step,
                "elapsed": elapsed, "tokens": tokens}, tmp)
    os.replace(tmp, WORK / "ckpt.pt")


if __name__ == "__main__":
    main()
