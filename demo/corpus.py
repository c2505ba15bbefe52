"""Build the demo model's training corpus from Debian packages (stdlib only, plus apt-get/dpkg).

Steps: `apt-get download` the packages named below, `dpkg -x` them under demo/work/root, extract
clean prose (SWORD zText/zCom modules, Python reST sources, the dictd Devil's Dictionary), split it
into documents, hold out every document whose stable hash falls in the validation bucket, and wrap
part of the documents in the harmony chat format so that chat replies learn to end with <|return|>.

Output: demo/work/corpus/{train,val}.jsonl, one {"src", "kind": "text"|"chat", "text"} per line.
Run: python demo/corpus.py   (about a minute; deterministic for a given --seed)
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import re
import struct
import subprocess
import zlib
from pathlib import Path

WORK = Path(__file__).resolve().parent / "work"
PACKAGES = ["sword-text-web", "sword-comm-mhcc", "sword-comm-tdavid", "python3.11-doc", "dict-devil"]
SWORD = "usr/share/sword/modules"
SWORD_MODULES = [  # (source name, data path, block-index extension prefix, verse-entry bytes)
    ("web", "texts/ztext/engWEB2015eb", "bz", 10),
    ("mhcc", "comments/zcom/mhcc", "bz", 10),
    ("tdavid", "comments/zcom/tdavid", "cz", 12),
]
MAX_ANSWER = 400  # characters (~100 tokens): chat replies stop well before 200 tokens
VAL_BUCKETS = 50  # 1 document in 50 goes to validation

# ---------------------------------------------------------------- download + unpack


def fetch(root: Path) -> None:
    debs = WORK / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    missing = [p for p in PACKAGES if not list(debs.glob(f"{p}_*.deb"))]
    if missing:
        subprocess.run(["apt-get", "download", *missing], cwd=debs, check=True)
    root.mkdir(parents=True, exist_ok=True)
    for deb in sorted(debs.glob("*.deb")):
        subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)


# ---------------------------------------------------------------- SWORD modules

_NOTE = re.compile(r"<note\b.*?</note>", re.S)
_PARA = re.compile(r'<div [^>]*type="x-p"[^>]*/>|<title\b[^>]*>|</title>|<lb\b[^>]*/>|<l\b[^>]*/>')
_TAG = re.compile(r"<[^>]+>")
_WS = re.compile(r"[ \t\u00a0]+")


def osis_to_text(raw: str) -> str:
    """OSIS markup -> text with '\n' at paragraph/title boundaries; notes dropped."""
    s = _NOTE.sub("", raw)
    s = _PARA.sub("\n", s)
    s = _TAG.sub("", s)
    s = s.replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"')
    lines = (_WS.sub(" ", ln).strip() for ln in s.split("\n"))
    return "\n".join(ln for ln in lines if ln)


def sword_entries(moddir: Path, testament: str, ext: str, entry_size: int) -> list[str]:
    """Each distinct verse/comment entry, in order. Blocks: (offset, size, usize) u32 triples."""
    idx = (moddir / f"{testament}.{ext}s").read_bytes()
    dat = (moddir / f"{testament}.{ext}z").read_bytes()
    blocks = []
    for i in range(0, len(idx), 12):
        off, size, _usize = struct.unpack_from("<3I", idx, i)
        blocks.append(zlib.decompress(dat[off:off + size]))
    vidx = (moddir / f"{testament}.{ext}v").read_bytes()
    fmt = "<IIH" if entry_size == 10 else "<III"
    out, seen = [], set()
    for i in range(0, len(vidx), entry_size):
        blk, off, size = struct.unpack_from(fmt, vidx, i)
        if size == 0 or (blk, off) in seen or blk >= len(blocks):
            continue  # empty verse or a linked entry repeating the previous text
        seen.add((blk, off))
        out.append(blocks[blk][off:off + size].decode("utf-8", "replace"))
    return out


def sword_documents(root: Path, name: str, path: str, ext: str, entry_size: int) -> list[dict]:
    """One document per chapter (Bible) or per chunk of ~12 comment entries (commentaries)."""
    moddir = root / SWORD / path
    docs: list[dict] = []
    for testament in ("ot", "nt"):
        if not (moddir / f"{testament}.{ext}s").stat().st_size:
            continue
        cur: list[str] = []
        for raw in sword_entries(moddir, testament, ext, entry_size):
            new_chapter = "<chapter " in raw and 'sID="' in raw
            if new_chapter and cur or len(cur) >= 40:
                docs.append(_sword_doc(name, cur))
                cur = []
            text = osis_to_text(raw)
            if text:
                cur.append(text)
        if cur:
            docs.append(_sword_doc(name, cur))
    return [d for d in docs if len(d["text"]) > 200]


def _sword_doc(name: str, entries: list[str]) -> dict:
    # Bible verses run on within a paragraph; commentary entries are paragraphs of their own.
    joiner = " " if name == "web" else "\n"
    text = joiner.join(entries)
    text = re.sub(r" *\n *", "\n", text)
    text = re.sub(r"(?m)^Verses? \d+(-\d+)?\s", "", text)  # MHCC verse-range headings
    return {"src": name, "text": text.strip()}


# ---------------------------------------------------------------- Python docs (reST)

_ROLE = re.compile(r":[a-z:+-]+:`!?~?([^`<]*?)(?:\s*<[^>]*>)?`")
_LINK = re.compile(r"`([^`<]+?)\s*<[^>]+>`_+")
_HEADING_RULE = re.compile(r"^([=\-~^\"'*#+`:.])\1{3,}\s*$")


def rst_to_paragraphs(text: str) -> list[str]:
    """Crude reST -> prose: drop directives, literal blocks, tables and indented blocks."""
    paras: list[str] = []
    cur: list[str] = []
    skip_indented = False
    for line in text.splitlines() + [""]:
        stripped = line.strip()
        indented = line[:1] in (" ", "\t")
        if skip_indented and (indented or not stripped):
            continue
        skip_indented = False
        if not stripped or _HEADING_RULE.match(stripped):
            if cur:
                paras.append(" ".join(cur))
                cur = []
            continue
        if stripped.startswith(".. ") or stripped.startswith("|") or stripped.startswith("+-"):
            if cur:
                paras.append(" ".join(cur))
                cur = []
            skip_indented = True  # a directive, comment or table: drop its body too
            continue
        if indented and not cur:
            skip_indented = True  # block quote / literal block / option list: not prose
            continue
        if stripped.endswith("::"):
            stripped = stripped[:-1] if not stripped.endswith(" ::") else stripped[:-3]
            cur.append(stripped)
            paras.append(" ".join(cur))
            cur = []
            skip_indented = True
            continue
        cur.append(stripped)
    out = []
    for p in paras:
        p = _LINK.sub(r"\1", p)
        p = _ROLE.sub(r"\1", p)
        p = p.replace("``", "").replace("**", "").replace("\\", "")
        p = re.sub(r"(?<!\w)\*([^*]+)\*(?!\w)", r"\1", p)
        p = re.sub(r"`([^`]+)`_?", r"\1", p)
        p = re.sub(r"\[#\w*\]_", "", p)
        p = _WS.sub(" ", p).strip()
        # keep prose paragraphs only: mostly letters, a sentence or more
        letters = sum(c.isalpha() or c == " " for c in p)
        if len(p) >= 60 and letters / len(p) > 0.85 and not p.startswith((">>>", "-", "*", "#")):
            out.append(p)
    return out


def python_documents(root: Path) -> list[dict]:
    src = root / "usr/share/doc/python3.11/html/_sources"
    docs = []
    for f in sorted(src.rglob("*.rst.txt")):
        rel = f.relative_to(src).as_posix()
        if rel.startswith(("whatsnew/changelog", "c-api/", "license")):
            continue
        paras = rst_to_paragraphs(f.read_text("utf-8", "replace"))
        for i in range(0, len(paras), 8):  # ~8 paragraphs per document
            docs.append({"src": "pydoc", "text": "\n".join(paras[i:i + 8])})
    return docs


# ---------------------------------------------------------------- The Devil's Dictionary (dictd)

_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _b64num(s: str) -> int:
    n = 0
    for c in s:
        n = n * 64 + _B64.index(c)
    return n


def devil_documents(root: Path) -> list[dict]:
    data = gzip.open(root / "usr/share/dictd/devil.dict.dz").read()
    docs = []
    for line in (root / "usr/share/dictd/devil.index").read_text("utf-8").splitlines():
        head, off, size = line.split("\t")
        if head.startswith("00database"):
            continue
        entry = data[_b64num(off):_b64num(off) + _b64num(size)].decode("utf-8", "replace")
        # join wrapped lines; keep blank-line paragraph breaks and verse lines
        paras = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", entry)]
        text = "\n".join(p for p in paras if p)
        text = re.sub(r"_([^_]+)_", r"\1", text)
        if len(text) > 40:
            docs.append({"src": "devil", "text": text, "head": head})
    return docs


# ---------------------------------------------------------------- harmony chat wrapping

SYSTEM_TMPL = ("You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n"
               "Current date: {date}\n\nReasoning: {effort}\n\n# Valid channels: analysis, commentary, "
               "final. Channel must be included for every message.{tools}")
TOOLS_LINE = "\nCalls to these tools must go to the commentary channel: 'functions'."
_SENT = re.compile(r"(?<=[.!?;:])[\"'”’)]*\s+(?=[\"“‘(]?[A-Z0-9])")
PROMPTS = ["{s}", "{s}", "{s}", "Tell me about this: {s}", "Continue: {s}", "Please go on. {s}",
           "What comes next? {s}", "Write a few sentences after this: {s}", "Explain: {s}"]
DEVIL_PROMPTS = ["What is {h}?", "Define {h}.", "What does {h} mean?", "{h}", "Tell me about {h}."]


def sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENT.split(text.replace("\n", " ")) if s.strip()]


def system_message(rng: random.Random) -> str:
    if rng.random() < 0.15:
        return ""  # some prompts come without the system message (raw templates, other clients)
    date = f"{rng.randint(2024, 2027)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    effort = rng.choice(["low", "medium", "medium", "high"])
    tools = TOOLS_LINE if rng.random() < 0.5 else ""
    return f"<|start|>system<|message|>{SYSTEM_TMPL.format(date=date, effort=effort, tools=tools)}<|end|>"


def chat_turn(user: str, answer: str) -> tuple[str, str]:
    return (f"<|start|>user<|message|>{user}<|end|><|start|>assistant",
            f"<|channel|>final<|message|>{answer}")


def chat_examples(doc: dict, rng: random.Random) -> list[str]:
    """Turn one document into chat examples of 1-3 sentences (at most ~400 characters) each."""
    if doc["src"] == "devil":
        head = doc["head"].lower() if rng.random() < 0.7 else doc["head"].capitalize()
        body = re.sub(r"^[A-Z][A-Z' -]*,\s*", "", doc["text"], count=1)
        answer = " ".join(sentences(body)[:3])[:MAX_ANSWER]
        user = rng.choice(DEVIL_PROMPTS).format(h=head)
        pairs = [chat_turn(user, answer)]
    else:
        sents = sentences(doc["text"])
        pairs, i = [], 1
        while i < len(sents):
            n = rng.randint(1, 3)
            answer = " ".join(sents[i:i + n])
            while len(answer) > MAX_ANSWER and n > 1:
                n -= 1
                answer = " ".join(sents[i:i + n])
            if len(answer) <= MAX_ANSWER:
                user = rng.choice(PROMPTS).format(s=sents[i - 1][:200].rstrip("?"))
                pairs.append(chat_turn(user, answer))
            i += n + 1
    out = []
    k = 0
    while k < len(pairs):
        # mostly single-turn; sometimes a second turn after the first answer (stored with <|end|>)
        turns = min(rng.choice([1, 1, 2, 3]), len(pairs) - k)
        text = system_message(rng)
        for j in range(turns):
            prompt, reply = pairs[k + j]
            last = j == turns - 1
            text += prompt + reply + ("<|return|>" if last else "<|end|>")
        out.append(text)
        k += turns
    return out


# ---------------------------------------------------------------- main


def is_val(doc: dict, index: int) -> bool:
    h = hashlib.sha256(f"{doc['src']}:{index}".encode()).digest()
    return h[0] % VAL_BUCKETS == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--chat-fraction", type=float, default=0.2, help="documents turned into chat examples")
    ap.add_argument("--no-fetch", action="store_true", help="reuse demo/work/root")
    args = ap.parse_args()
    root = WORK / "root"
    if not args.no_fetch:
        fetch(root)
    docs: list[dict] = []
    for name, path, ext, size in SWORD_MODULES:
        docs += sword_documents(root, name, path, ext, size)
    docs += python_documents(root)
    docs += devil_documents(root)
    rng = random.Random(args.seed)
    outdir = WORK / "corpus"
    outdir.mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {}
    per_src_index: dict[str, int] = {}
    with open(outdir / "train.jsonl", "w") as ftr, open(outdir / "val.jsonl", "w") as fva:
        for doc in docs:
            idx = per_src_index.get(doc["src"], 0)
            per_src_index[doc["src"]] = idx + 1
            f = fva if is_val(doc, idx) else ftr
            chat_p = 0.6 if doc["src"] == "devil" else args.chat_fraction
            if rng.random() < chat_p:
                items = [("chat", t) for t in chat_examples(doc, rng)]
            else:
                items = [("text", doc["text"])]
            for kind, text in items:
                f.write(json.dumps({"src": doc["src"], "kind": kind, "text": text}) + "\n")
                key = f"{'val' if f is fva else 'train'}/{doc['src']}/{kind}"
                counts[key] = counts.get(key, 0) + len(text)
    for k in sorted(counts):
        print(f"{k:24s} {counts[k] / 1e6:7.2f} MB")


if __name__ == "__main__":
    main()
