"""Writes docs/benchmarks.md, and README.md's speed table, from the records in bench/results/.

    python bench/report.py           # rewrite both from bench/results/*.json
    python bench/report.py --check   # exit 1 if either differs from what the records give

The page is bench/results/intro.md, then one section per bench (newest day first): the
machine, date, command, versions and source of each record above its table. README.md's table
(between the `speed-table` markers) comes from the newest `vs_llamacpp` record marked
`"headline": true` (set it by hand in the record of a full run on a quiet machine).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import record  # noqa: E402

REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
DOC = os.path.join(REPO, "docs", "benchmarks.md")
README = os.path.join(REPO, "README.md")
README_BEGIN = "<!-- speed-table: written by bench/report.py from bench/results; do not edit -->"
README_END = "<!-- /speed-table -->"

# Section order, title and what each bench measures.
BENCHES = {
    "vs_llamacpp": ("hybridmoe vs llama.cpp", "bench/vs_llamacpp.py",
                    "Same GGUF, same threads, each engine in a fresh child process with the file in the page "
                    "cache; medians of alternating runs. pp = prompt tokens/s, tg = decode tokens/s."),
    "kernels": ("Kernel throughput", "bench/kernels.py",
                "20b shapes (H = I = 2880, 32 experts, top-4). GB/s of weight bytes for the memory-bound cases "
                "(one token), GFLOP/s for the compute-bound ones; \"cold\" cycles through all experts so the "
                "weights come from RAM. `fast` is `--fast-math` (int8 activations)."),
    "roofline": ("Decode roofline", "bench/roofline.py",
                 "Weight bytes one decode step of S concurrent streams reads (dense tensors once, each expert "
                 "some stream picked, uniform routing) and the tok/s the same-run read bandwidth allows: "
                 "the ceiling no engine can pass on that machine."),
    "conversation": ("Conversations: prompt reuse per turn", "bench/conversation.py",
                     "Every request resends the whole conversation as token ids on `/completion`; cached = "
                     "prompt tokens the server did not recompute, ttft = time to first token at the client."),
    "serve_load": ("Concurrent streams through the server", "bench/serve_load.py",
                   "N streaming chat clients at once; aggregate generated tokens/s and latencies."),
    "gguf_open": ("Opening a GGUF", "bench/gguf_open.py",
                  "Open time and RSS of the project's reader vs `gguf.GGUFReader` on a 20b-shaped file with "
                  "the full-size tokenizer, each open in a fresh process."),
    "decode_breakdown": ("Where a decode step's time goes", "bench/decode_breakdown.py",
                         "One-token decode steps after a cached prompt, each part of every layer timed; GB/s of "
                         "the bytes each part reads per token against the read bandwidth the same child "
                         "measured. Medians over steps, then over runs (modes alternating)."),
    "api_env": ("The Python API against the CLI", "bench/api_env.py",
                "The same greedy generation through `hybridmoe generate` and through `LLM.generate` with "
                "OMP_WAIT_POLICY unset, set to PASSIVE, and with torch imported first; fresh process each, "
                "alternating."),
    "sampling": ("Choosing a token", "bench/sampling.py",
                 "`Sampler.sample` + `accept` per token on a random 201k-token logit row; median of the "
                 "runs' means."),
    "speculative": ("Self-speculative decoding", "bench/speculative.py",
                    "Greedy decode tok/s, plain vs `--spec-type ngram-simple`, same model and run (replies "
                    "checked identical). The synthetic model never repeats itself, so the \"drafts right "
                    "p\" rows propose the plain reply's next tokens spoiled with probability 1 - p (draft "
                    "quality under control); \"real lookup\" rows use the n-gram lookup itself."),
    "constrained_load": ("Big JSON schemas beside a normal chat", "bench/constrained_load.py",
                         "Does one request's huge schema stall the other slot?"),
    "gpu_check": ("GPU placements", "bench/gpu_check.py",
                  "GPU logits vs CPU logits, then pp512 / tg128 and peak VRAM per placement."),
    "gpu_profile": ("Where a decode step's time goes, per placement", "bench/gpu_profile.py",
                    "Greedy one-token decode steps after a 512-token prompt; torch.profiler counts of kernel "
                    "launches and host syncs per step."),
}

# Display names of the vs_llamacpp metrics.
METRICS = {
    "load_s": "load (s)",
    "first_prefill_s": "first 64-token prefill after load (s)",
    "load_to_first_s": "load + first prefill (s)",
    "pp128": "pp128 (tok/s)",
    "pp512": "pp512 (tok/s)",
    "tg64": "tg64 (tok/s)",
    "peak_rss_gib": "peak RSS (GiB)",
    "anon_gib": "peak anonymous memory (GiB)",
    "file_rss_gib": "peak resident file pages (GiB)",
}
README_METRICS = ("load_s", "load_to_first_s", "pp512", "tg64", "peak_rss_gib")

_ISA_NAMES = {"avx512f": "F", "avx512bw": "BW", "avx512vl": "VL", "avx512_vnni": "VNNI", "avx512vbmi": "VBMI",
              "avx512_bf16": "BF16"}


def load_records(directory: str = RESULTS) -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        with open(path) as f:
            rec = json.load(f)
        problems = record.check(rec)
        if problems:
            raise SystemExit(f"{path}: {'; '.join(problems)}")
        rec["_file"] = os.path.basename(path)
        out.append(rec)
    return out


def machine_label(m: dict) -> str:
    isa = m.get("isa", [])
    avx512 = [name for flag, name in _ISA_NAMES.items() if flag in isa]
    simd = f"AVX-512 {'/'.join(avx512)}" if avx512 else "AVX2" if "avx2" in isa else "no AVX2"
    if "avx_vnni" in isa:
        simd += ", AVX-VNNI"
    parts = [m["cpu"] + (f" ({m['note']})" if m.get("note") else ""), f"{m['cpus']} CPUs" if m.get("cpus") else "",
             f"{m['ram_gib']:g} GiB" if m.get("ram_gib") else "", simd]
    return ", ".join(p for p in parts if p)


def fmt(value: object, column: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value).replace("|", "\\|")
    if "share" in column:
        return f"{value:.0%}"
    if isinstance(value, int):
        text = str(value)
    elif value != 0 and abs(value) < 0.1:
        text = f"{value:.2g}"
    else:  # at most 2 decimals (1 from 100 up), no trailing zeros: a typed-in 25.6 stays 25.6
        text = (f"{value:.2f}" if abs(value) < 100 else f"{value:.1f}").rstrip("0").rstrip(".")
    return text + "×" if " / " in column else text


def table(rows: list[dict], labels: dict[str, str] | None = None) -> list[str]:
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    first = cols[0]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [(labels or {}).get(r.get(first), fmt(r.get(first), first)) if c == first else fmt(r.get(c), c)
                 for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def conversation_table(rows: list[dict]) -> list[str]:
    """One line per turn, one column per engine / setting / session: cached / prompt, ttft."""
    keys = []
    for r in rows:
        k = (r["engine"], r["setting"], r["session"])
        if k not in keys:
            keys.append(k)
    turns = sorted({r["turn"] for r in rows})
    by = {(r["engine"], r["setting"], r["session"], r["turn"]): r for r in rows}
    head = ["turn"] + [f"{e} {s}" + (f" s{n}" if any(k[:2] == (e, s) and k[2] for k in keys) else "")
                       for e, s, n in keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in turns:
        cells = [str(t)]
        for k in keys:
            r = by.get((*k, t))
            if r is None:
                cells.append("–")
                continue
            cached, prompt, ttft = r.get("cached_tokens"), r.get("prompt_tokens"), r.get("ttft_ms")
            part = []
            if cached is not None and prompt:
                part.append(f"{cached} / {prompt} ({100 * cached / prompt:.1f}%)")
            if ttft is not None:
                part.append(f"{ttft / 1000:.1f} s")
            cells.append(", ".join(part) or "–")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _versions(v: dict) -> str:
    parts = [f"hybridmoe {v['hybridmoe']}" if v.get("hybridmoe") not in (None, "unknown") else ""]
    llama = v.get("llama.cpp")
    if isinstance(llama, dict):
        parts.append(f"llama.cpp: {llama.get('driver', '')} {llama.get('version', '')}".strip())
    elif llama:
        parts.append(f"llama.cpp: {llama}")
    for k in ("torch", "python"):
        if v.get(k):
            parts.append(f"{k} {v[k]}")
    return ", ".join(p for p in parts if p)


def _load(m: dict) -> str:
    start, end = m.get("load_avg"), m.get("load_avg_end")
    if not start:
        return ""
    s = "load average " + " ".join(f"{x:g}" for x in start)
    return s + (" at the start, " + " ".join(f"{x:g}" for x in end) + " at the end" if end else "")


def render_record(rec: dict) -> list[str]:
    date = rec["date"].replace("T", " ").replace("Z", " UTC")
    lines = [f"### {date} · {machine_label(rec['machine'])}", ""]
    facts = [f"`{rec['command']}`", rec["source"], _versions(rec["versions"]), _load(rec["machine"])]
    lines.append("; ".join(f for f in facts if f) + ".")
    if rec.get("notes"):
        lines += ["", rec["notes"].strip()]
    lines.append("")
    if rec["bench"] == "conversation":
        lines += conversation_table(rec["rows"])
    else:
        lines += table(rec["rows"], METRICS if rec["bench"] == "vs_llamacpp" else None)
    return lines + [""]


def _newest_first(rec: dict) -> tuple[str, str]:
    """By day (a transcribed record may give no time), then file name (name files bench-date-...)."""
    return rec["date"][:10], rec["_file"]


def render_doc(records: list[dict], intro: str) -> str:
    lines = [intro.rstrip(), ""]
    order = list(BENCHES) + sorted({r["bench"] for r in records} - set(BENCHES))
    for bench in order:
        recs = sorted((r for r in records if r["bench"] == bench), key=_newest_first, reverse=True)
        if not recs:
            continue
        title, script, what = BENCHES.get(bench, (bench, f"bench/{bench}.py", ""))
        lines += [f"## {title} (`{script}`)", ""]
        if what:
            lines += [what, ""]
        for rec in recs:
            lines += render_record(rec)
    return "\n".join(lines).rstrip() + "\n"


def speed_table(records: list[dict]) -> str:
    """README's short table: the main metrics of the newest vs_llamacpp record marked `"headline": true`."""
    recs = sorted((r for r in records if r["bench"] == "vs_llamacpp" and r.get("headline")), key=_newest_first)
    if not recs:
        return "No headline vs_llamacpp record in bench/results yet."
    rec = recs[-1]
    rows = [r for r in rec["rows"] if r.get("metric") in README_METRICS]
    p = rec["params"]
    llama = rec["versions"].get("llama.cpp")
    if isinstance(llama, dict):
        llama = f"{llama.get('driver', '')} {llama.get('version', '')}".strip()
    head = (f"{rec['date'][:10]}, {machine_label(rec['machine'])}; {p.get('model', '?')}, {p.get('threads', '?')}"
            f" threads" + (f"; llama.cpp: {llama}" if llama else "") + f" (`{rec['command']}`):")
    return "\n".join([head, "", *table(rows, METRICS)])


def render_readme(readme: str, records: list[dict]) -> str:
    if README_BEGIN not in readme or README_END not in readme:
        raise SystemExit(f"README.md lacks the markers {README_BEGIN!r} ... {README_END!r}")
    before, rest = readme.split(README_BEGIN, 1)
    _, after = rest.split(README_END, 1)
    return f"{before}{README_BEGIN}\n{speed_table(records)}\n{README_END}{after}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 when a file is stale")
    args = ap.parse_args()
    records = load_records()
    with open(os.path.join(RESULTS, "intro.md")) as f:
        doc = render_doc(records, f.read())
    with open(README) as f:
        readme_now = f.read()
    readme = render_readme(readme_now, records)
    with open(DOC) as f:
        doc_now = f.read()
    stale = [p for p, new, now in ((DOC, doc, doc_now), (README, readme, readme_now)) if new != now]
    if args.check:
        for p in stale:
            print(f"{os.path.relpath(p, REPO)} is stale: run python bench/report.py")
        return 1 if stale else 0
    for path, text in ((DOC, doc), (README, readme)):
        with open(path, "w") as f:
            f.write(text)
    print(f"wrote {os.path.relpath(DOC, REPO)} ({len(records)} records) and README.md's speed table")
    return 0


if __name__ == "__main__":
    sys.exit(main())
