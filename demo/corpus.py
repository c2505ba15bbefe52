"""Build the demo model's training corpus from Debian packages (apt-get/dpkg, the stdlib, and the
project's own chat template renderer).

Steps: `apt-get download` the packages named below, `dpkg -x` them under demo/work/root, extract
clean prose (SWORD zText/zCom modules, Python reST sources, the dictd Devil's Dictionary), split it
into documents, hold out every document whose stable hash falls in the validation bucket, and turn
part of the documents into harmony chat conversations rendered exactly as `hybridmoe serve` renders
them (demo/chat_format.py): whole answers of 1-3 sentences, analysis-channel reasoning before some of
them (by reasoning effort), and verse-lookup conversations that call the demo tool `lookup_verse`
(call, tool output, final answer quoting it). The WEB verse table the tool reads is written to
demo/web_verses.tsv.xz.

Output: demo/work/corpus/{train,val}.jsonl, one {"src", "kind": "text"|"chat"|"tool"|"drill", "text"} per line.
Run: python demo/corpus.py   (about 20 s; deterministic for a given --seed)
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import lzma
import random
import sys
import re
import struct
import subprocess
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORK = HERE / "work"
VERSE_TABLE = HERE / "web_verses.tsv.xz"  # committed: demo/lookup_verse.py reads it
sys.path.insert(0, str(HERE))
from chat_format import LOOKUP_VERSE_TOOL, call_message, final_reply, render_prompt, tool_call_reply  # noqa: E402
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
    s = _NOTE.sub(" ", raw)  # a note often sits between two words
    s = _PARA.sub("\n", s)
    s = _TAG.sub("", s)
    s = s.replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"')
    lines = (re.sub(r" ([,.;:!?’”)])", r"\1", _WS.sub(" ", ln)).strip() for ln in s.split("\n"))
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


# ---------------------------------------------------------------- WEB verse table (the demo tool's data)

_BOOK_START = re.compile(r'<div\b(?=[^>]*\bsID=)(?=[^>]*type="book")[^>]*osisID="([^"]+)"')
_BOOK_NAME = re.compile(r'<milestone n="([^"]+)" type="x-usfm-h"')
_CHAPTER_START = re.compile(r'<chapter\b(?=[^>]*\bsID=)[^>]*\bn="(\d+)"')
CANON = 66  # the Protestant canon: the deuterocanonical books are left out of the tool's table


def web_verses(root: Path) -> list[tuple[str, int, int, str]]:
    """(book, chapter, verse, text) for every verse of the WEB module, walking the versification
    index: a book heading entry, then per chapter a heading entry and one entry per verse."""
    moddir = root / SWORD / "texts/ztext/engWEB2015eb"
    out: list[tuple[str, int, int, str]] = []
    for testament in ("ot", "nt"):
        idx = (moddir / f"{testament}.bzs").read_bytes()
        dat = (moddir / f"{testament}.bzz").read_bytes()
        blocks = [zlib.decompress(dat[o:o + s]) for o, s, _ in
                  (struct.unpack_from("<3I", idx, i) for i in range(0, len(idx), 12))]
        vidx = (moddir / f"{testament}.bzv").read_bytes()
        book, chapter, verse = "", 0, 0
        for i in range(0, len(vidx), 10):
            blk, off, size = struct.unpack_from("<IIH", vidx, i)
            raw = blocks[blk][off:off + size].decode("utf-8", "replace") if size and blk < len(blocks) else ""
            starts = _BOOK_START.findall(raw)
            if starts:
                names = _BOOK_NAME.findall(raw)
                book, chapter, verse = (names[-1] if names else starts[-1]), 0, 0
                continue
            m = _CHAPTER_START.search(raw)
            if m:
                chapter, verse = int(m.group(1)), 0
                continue
            if chapter == 0:
                continue
            verse += 1
            text = " ".join(osis_to_text(raw).split())
            if text:
                out.append((book, chapter, verse, text))
    books = list(dict.fromkeys(b for b, _, _, _ in out))
    canon = [b for b in books if b not in DEUTEROCANON]
    return [v for v in out if v[0] in canon]


DEUTEROCANON = {"Tobit", "Judith", "Esther (Greek)", "Wisdom of Solomon", "Sirach", "Baruch", "Daniel (Greek)",
                "1 Maccabees", "2 Maccabees", "1 Esdras", "Prayer of Manasses", "Psalm 151", "3 Maccabees",
                "2 Esdras", "4 Maccabees"}


def write_verse_table(verses: list[tuple[str, int, int, str]], path: Path) -> None:
    with lzma.open(path, "wt", encoding="utf-8", preset=9 | lzma.PRESET_EXTREME) as f:
        for book, chapter, verse, text in verses:
            f.write(f"{book}\t{chapter}\t{verse}\t{text}\n")


# ---------------------------------------------------------------- harmony chat wrapping

SOURCE_NAMES = {"web": "the World English Bible", "mhcc": "Matthew Henry's commentary",
                "tdavid": "Spurgeon's Treasury of David", "pydoc": "the Python documentation",
                "devil": "The Devil's Dictionary"}
_SENT = re.compile(r"(?<=[.!?;:])[\"'”’)]*\s+(?=[\"“‘(]?[A-Z0-9])")
PROMPTS = ["{s}", "{s}", "Tell me about this: {s}", "Continue: {s}", "Please go on. {s}",
           "What comes next? {s}", "Write a few sentences after this: {s}", "Explain: {s}"]
TOPIC_PROMPTS = ["What is {k}?", "Tell me about {k}.", "Say something about {k}.", "Explain {k}.",
                 "What can you tell me about {k}?", "Describe {k}.", "Write a few sentences about {k}.",
                 "What do you know about {k}?", "Give me some thoughts on {k}.", "Why {k}?"]
DEVIL_PROMPTS = ["What is {h}?", "Define {h}.", "What does {h} mean?", "{h}", "Tell me about {h}.",
                 "What is the meaning of {h}?", "Explain {h}."]
REASONING = [
    "The user asks about {t}. {S} speaks of this. I will answer in a few sentences.",
    "The user asks about {t}. {S} says: {q} I will keep the answer short.",
    "The question is about {t}. I can answer from {s}.",
    "The user wants to know about {t}. {S} has a passage on it. Answer briefly and plainly.",
    "The user asks: {u} This is about {t}. {S} says: {q}",
]
USER_INSTRUCTIONS = ["You are a helpful assistant.", "Answer briefly.", "You are a helpful assistant. Be concise.",
                     "Reply in plain English."]
REASONING_P = {"low": 0.0, "medium": 0.9, "high": 1.0}  # share of answers with analysis, by effort
_HEADING = re.compile(r"^(?:Ver(?:se|s)?s?\.?\s*[\d\-–, ]*\.?|\d+[\d\-–,:. ]*|[IVXLC]+\.)\s*")
_POS = re.compile(r"^(?:(?:n|v|adj|adv|pp|p|prep|conj|pron|interj|x|t|i)\.\s*)+")
_STOP = set("about above after again against because before being below between could doing during every "
            "further having however might other shall should their there these thing things those through "
            "under until which while would whose where itself there's".split())


def sentences(text: str) -> list[str]:
    """Sentences, with heading fragments ("Ver. 3.", "2.", "Verse 4.") dropped."""
    out = []
    for s in _SENT.split(text.replace("\n", " ")):
        s = _HEADING.sub("", s.strip()).strip()
        if len(s.split()) >= 3:
            out.append(s)
    return out


def whole_answer(answer: str) -> bool:
    """At least five words and starting like a sentence, not a fragment."""
    return len(answer.split()) >= 5 and (answer[:1].isalpha() or answer[:1] in "\"“‘(")


def keyword(answer: str, rng: random.Random) -> str | None:
    words = [w.strip(".,;:!?\"“”‘’()'") for w in answer.split()[:25]]
    cands = [w for w in words if len(w) >= 5 and w.isalpha() and w.lower() not in _STOP]
    if not cands:
        return None
    w = rng.choice(cands)
    return w if w[0].isupper() and w.lower() not in ("the",) and rng.random() < 0.5 else w.lower()


def settings(rng: random.Random) -> tuple[str, str]:
    date = f"{rng.randint(2024, 2027)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    return rng.choice(["low", "low", "medium", "medium", "medium", "medium", "medium", "high", "high", "high"]), date


def reasoning_text(src: str, user: str, topic: str, answer: str, rng: random.Random) -> str:
    s_name = SOURCE_NAMES[src]
    quote = " ".join(answer.split()[:rng.randint(6, 12)]).rstrip(",;:") + " ..."
    return rng.choice(REASONING).format(t=topic, S=s_name[0].upper() + s_name[1:], s=s_name, q=quote,
                                        u=user if user.endswith(("?", ".", "!")) else user + ".")


def chat_pairs(doc: dict, rng: random.Random) -> list[tuple[str, str, str]]:
    """(user, answer, topic) pairs from one document; answers are 1-3 whole sentences."""
    if doc["src"] == "devil":
        head = doc["head"].lower() if rng.random() < 0.7 else doc["head"].capitalize()
        body = re.sub(r"^[A-Z][A-Z' -]*,\s*", "", doc["text"], count=1)
        body = _POS.sub("", body)
        answer = " ".join(sentences(body)[:3])[:MAX_ANSWER]
        if not whole_answer(answer):
            return []
        return [(rng.choice(DEVIL_PROMPTS).format(h=head), answer, head)]
    sents = sentences(doc["text"])
    pairs, i = [], 1
    while i < len(sents):
        n = rng.randint(1, 3)
        answer = " ".join(sents[i:i + n])
        while len(answer) > MAX_ANSWER and n > 1:
            n -= 1
            answer = " ".join(sents[i:i + n])
        if len(answer) <= MAX_ANSWER and whole_answer(answer):
            kw = keyword(answer, rng)
            if kw and rng.random() < 0.5:
                user, topic = rng.choice(TOPIC_PROMPTS).format(k=kw), kw
            else:
                prev = sents[i - 1][:200].rstrip("?")
                user, topic = rng.choice(PROMPTS).format(s=prev), " ".join(prev.split()[:6]).rstrip(",;:.")
            pairs.append((user, answer, topic))
        i += n + 1
    return pairs


def chat_examples(doc: dict, rng: random.Random) -> list[str]:
    """Conversations of 1-3 turns rendered by the server's template; the last answer is the
    model's output (optionally with analysis first), earlier answers are history (<|end|>)."""
    pairs = chat_pairs(doc, rng)
    out, k = [], 0
    while k < len(pairs):
        turns = min(rng.choice([1, 1, 1, 2, 3]), len(pairs) - k)
        effort, date = settings(rng)
        messages: list[dict] = []
        if rng.random() < 0.1:
            messages.append({"role": "system", "content": rng.choice(USER_INSTRUCTIONS)})
        tools = [LOOKUP_VERSE_TOOL] if rng.random() < 0.1 else None  # tool offered but not needed
        for j in range(turns - 1):
            user, answer, _ = pairs[k + j]
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        user, answer, topic = pairs[k + turns - 1]
        messages.append({"role": "user", "content": user})
        reasoning = reasoning_text(doc["src"], user, topic, answer, rng) if rng.random() < REASONING_P[effort] else ""
        out.append(render_prompt(messages, tools, effort, date) + final_reply(answer, reasoning))
        k += turns
    return out


# ---------------------------------------------------------------- tool-call conversations

VERSE_QUESTIONS = ["What does {r} say?", "What does {r} say?", "Look up {r}.", "Quote {r}.",
                   "Can you show me {r}?", "What is written in {r}?", "Read {r} to me.", "{r}?",
                   "Find {r} in the Bible.", "Please give me the text of {r}.", "What is {r}?",
                   "I'd like to read {r}.", "Show me {r}, please.", "What are the words of {r}?"]
TOOL_REASONING = ["The user asks for {r}. I will look it up with lookup_verse.",
                  "The user wants the text of {r}. Call lookup_verse with book {b}, chapter {c}, verse {v}.",
                  "I need {r}. Look it up."]
VERSE_ANSWERS = ["{r} says: \"{t}\"", "{r} reads: \"{t}\"", "In the World English Bible, {r} says: \"{t}\"",
                 "Here is {r}: \"{t}\"", "\"{t}\" ({r})"]
# The verse questions of demo/chat_check.py: never asked in training, so the check measures the skill.
HELDOUT_VERSES = {("John", 3, 16), ("Psalms", 23, 1), ("Genesis", 1, 1), ("Romans", 8, 28),
                  ("Proverbs", 3, 5), ("Matthew", 5, 9), ("Isaiah", 40, 31), ("1 Corinthians", 13, 4),
                  ("Philippians", 4, 13), ("Mark", 10, 14), ("Jeremiah", 29, 11), ("Luke", 2, 11)}


def reference(book: str, chapter: int, verse: int, rng: random.Random) -> str:
    name = "Psalm" if book == "Psalms" and rng.random() < 0.6 else book
    if rng.random() < 0.1:
        name = name.lower()
    return f"{name} {chapter}:{verse}"


def tool_example(book: str, chapter: int, verse: int, text: str, rng: random.Random) -> str:
    """User asks for a verse -> call -> tool output -> final answer quoting it, as one rendered string."""
    effort, date = settings(rng)
    ref = reference(book, chapter, verse, rng)
    messages: list[dict] = []
    if rng.random() < 0.1:
        messages.append({"role": "system", "content": rng.choice(USER_INSTRUCTIONS)})
    messages.append({"role": "user", "content": rng.choice(VERSE_QUESTIONS).format(r=ref)})
    tools = [LOOKUP_VERSE_TOOL]
    args = {"book": book, "chapter": chapter, "verse": verse}
    reasoning = ""
    if rng.random() < REASONING_P[effort]:
        reasoning = rng.choice(TOOL_REASONING).format(r=ref, b=book, c=chapter, v=verse)
    first = render_prompt(messages, tools, effort, date) + tool_call_reply("lookup_verse", args, reasoning)
    shown = f"{book} {chapter}:{verse}"
    messages += [call_message("lookup_verse", args, reasoning),
                 {"role": "tool", "tool_call_id": "call_0", "content": text}]
    full = render_prompt(messages, tools, effort, date)
    assert full.startswith(first), "the template must re-render a tool call exactly as the model wrote it"
    answer = rng.choice(VERSE_ANSWERS).format(r=shown, t=text)
    return full + final_reply(answer)


def drill_document(verses: list[tuple[str, int, int, str]], rng: random.Random, answer_share: float) -> str:
    """Copy drills: the two copies a verse lookup needs (reference -> JSON arguments, tool output ->
    quoted answer), several per document and without the system/developer preamble, so that the
    model sees many copy events per window; the full conversations above teach the real prompt."""
    parts = []
    for _ in range(rng.randint(6, 10)):
        book, chapter, verse, text = rng.choice(verses)
        ref = reference(book, chapter, verse, rng)
        args = {"book": book, "chapter": chapter, "verse": verse}
        user = rng.choice(VERSE_QUESTIONS).format(r=ref)
        part = f"<|start|>user<|message|>{user}<|end|><|start|>assistant" + tool_call_reply("lookup_verse", args)
        if rng.random() < answer_share:
            answer = rng.choice(VERSE_ANSWERS).format(r=f"{book} {chapter}:{verse}", t=text)
            part += (f"<|start|>functions.lookup_verse to=assistant<|channel|>commentary<|message|>{text}<|end|>"
                     f"<|start|>assistant" + final_reply(answer))
        parts.append(part)
    return "".join(parts)


# ---------------------------------------------------------------- main


def is_val(doc: dict, index: int) -> bool:
    h = hashlib.sha256(f"{doc['src']}:{index}".encode()).digest()
    return h[0] % VAL_BUCKETS == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--chat-fraction", type=float, default=0.3, help="documents turned into chat examples")
    ap.add_argument("--text-fraction", type=float, default=0.3,
                    help="share of the remaining (non-chat) documents kept as plain text")
    ap.add_argument("--tool-examples", type=int, default=8000, help="verse-lookup conversations")
    ap.add_argument("--drill-docs", type=int, default=7000, help="documents of verse-lookup copy drills")
    ap.add_argument("--drill-answer-share", type=float, default=0.7,
                    help="share of drill lookups that also carry the tool output and the quoted answer")
    ap.add_argument("--no-fetch", action="store_true", help="reuse demo/work/root")
    args = ap.parse_args()
    root = WORK / "root"
    if not args.no_fetch:
        fetch(root)
    verses = web_verses(root)
    write_verse_table(verses, VERSE_TABLE)
    print(f"{len(verses)} verses -> {VERSE_TABLE} ({VERSE_TABLE.stat().st_size / 1e6:.2f} MB)")
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
    rows: dict[str, list[dict]] = {"train": [], "val": []}
    for doc in docs:
        idx = per_src_index.get(doc["src"], 0)
        per_src_index[doc["src"]] = idx + 1
        split = "val" if is_val(doc, idx) else "train"
        chat_p = 0.7 if doc["src"] == "devil" else args.chat_fraction
        if rng.random() < chat_p:
            rows[split] += [{"src": doc["src"], "kind": "chat", "text": t} for t in chat_examples(doc, rng)]
        elif rng.random() < args.text_fraction or split == "val":
            rows[split].append({"src": doc["src"], "kind": "text", "text": doc["text"]})
    pool = [v for v in verses if (v[0], v[1], v[2]) not in HELDOUT_VERSES and len(v[3]) <= 300]
    for i in range(args.tool_examples):
        v = rng.choice(pool)
        split = "val" if i % VAL_BUCKETS == 0 else "train"
        rows[split].append({"src": "web", "kind": "tool", "text": tool_example(*v, rng)})
    for i in range(args.drill_docs):
        split = "val" if i % VAL_BUCKETS == 0 else "train"
        rows[split].append({"src": "web", "kind": "drill", "text": drill_document(pool, rng, args.drill_answer_share)})
    for split, items in rows.items():
        rng.shuffle(items)  # tool conversations spread through the stream, not in one block
        with open(outdir / f"{split}.jsonl", "w") as f:
            for r in items:
                f.write(json.dumps(r) + "\n")
                key = f"{split}/{r['src']}/{r['kind']}"
                counts[key] = counts.get(key, 0) + len(r["text"])
    for k in sorted(counts):
        print(f"{k:24s} {counts[k] / 1e6:7.2f} MB")


if __name__ == "__main__":
    main()
