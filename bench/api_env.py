"""Is the Python API as fast as the CLI, whatever the OpenMP environment and import order?

    python bench/api_env.py -m FILE.gguf [-t 2] [--runs 3] [--prompt-tokens 256] [--tokens 48] [--json out.json]

Four ways to run the same greedy generation (same prompt, same token count), each a fresh
process, alternating over `--runs`:
  cli             `hybridmoe generate` (which set OMP_WAIT_POLICY=PASSIVE before 2026-12-06)
  api             `LLM(...).generate`, OMP_WAIT_POLICY unset, hybridmoe imported first
  api-torch-first the same with `import torch` before hybridmoe
  api-passive     the same as api with OMP_WAIT_POLICY=PASSIVE in the environment
OMP_NUM_THREADS is unset in every child, as on a user's machine. Prints prompt and decode tok/s
(the engine's own timings), medians and ranges per way.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

import machine
import record

WAYS = ("cli", "api", "api-torch-first", "api-passive")
API_CHILD = """
import json, sys
{pre}
from hybridmoe import LLM, ComputeSettings, ContextSettings
llm = LLM({model!r}, compute=ComputeSettings(threads={threads}), context=ContextSettings(ctx_size=4096))
res = llm.generate({prompt!r}, max_tokens={tokens}, temperature=0.0, ignore_eos=True)
print(json.dumps({{"prompt": res.timings["prompt_per_second"], "decode": res.timings["predicted_per_second"]}}))
"""


def run_way(way: str, args: argparse.Namespace, prompt: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    if way == "cli":
        cmd = [sys.executable, "-m", "hybridmoe.cli", "generate", "-m", args.model, "-p", prompt, "-n",
               str(args.tokens), "--ignore-eos", "--temp", "0", "-t", str(args.threads), "-c", "4096"]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        m = re.search(r"prompt \d+ tok, ([\d.]+) tok/s \| decode \d+ tok, ([\d.]+) tok/s", r.stderr)
        if r.returncode != 0 or not m:
            raise SystemExit(f"cli run failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
        return {"prompt": float(m.group(1)), "decode": float(m.group(2))}
    if way == "api-passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    code = API_CHILD.format(pre="import torch" if way == "api-torch-first" else "", model=args.model,
                            threads=args.threads, prompt=prompt, tokens=args.tokens)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise SystemExit(f"{way} run failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=256, help="about this many prompt tokens")
    ap.add_argument("--tokens", type=int, default=48, help="tokens to generate")
    ap.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    record.add_json_arg(ap)
    args = ap.parse_args()
    print(machine.describe())
    prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * max(1, args.prompt_tokens // 9))
    rec = record.new("api_env", {"model": os.path.basename(args.model), "threads": args.threads, "runs": args.runs,
                                 "tokens": args.tokens, "ways": args.ways})
    got: dict[str, list[dict[str, float]]] = {w: [] for w in args.ways}
    for run in range(args.runs):
        for way in args.ways if run % 2 == 0 else args.ways[::-1]:
            r = run_way(way, args, prompt)
            got[way].append(r)
            rec["runs"].append({"run": run, "way": way, **r})
            print(f"run {run} {way}: prompt {r['prompt']:.2f} tok/s, decode {r['decode']:.2f} tok/s", flush=True)
    rows = []
    for way, rs in got.items():
        row: dict = {"way": way}
        for k in ("prompt", "decode"):
            vals = [r[k] for r in rs]
            row[f"{k} tok/s"] = statistics.median(vals)
            row[f"{k} min-max"] = f"{min(vals):.2f}-{max(vals):.2f}"
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["decode / " + base["way"]] = row["decode tok/s"] / base["decode tok/s"]
    print(f"\n{'way':16} {'prompt tok/s':>13} {'range':>14} {'decode tok/s':>13} {'range':>12} {'decode vs ' + base['way']:>12}")
    for row in rows:
        print(f"{row['way']:16} {row['prompt tok/s']:13.2f} {row['prompt min-max']:>14} {row['decode tok/s']:13.2f}"
              f" {row['decode min-max']:>12} {row['decode / ' + base['way']]:11.2f}x")
    rec["rows"] = rows
    record.write(rec, args.json)


if __name__ == "__main__":
    main()
