#!/usr/bin/env bash
# Profile decode steps on a CUDA machine: build the kernels, write the 20b-shaped file, then
# bench/gpu_profile.py for --cpu-moe, all on the GPU and CPU-only. Outputs go to $1 (default bench/out).
set -euo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${1:-bench/out}"
mkdir -p "$OUTDIR"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
PYTHONPATH=src "$PY" -c "import hybridmoe.kernels as k, sys; sys.exit(0 if k.available() else 1)" 2>/dev/null \
    || "$PY" setup.py -q build_ext --inplace
export PYTHONPATH="$PWD/src:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}"
MODEL="${MODEL:-bench/out/synth-20b.gguf}"
mkdir -p "$(dirname "$MODEL")"; [ -f "$MODEL" ] || "$PY" -m hybridmoe.cli synth --preset 20b --out "$MODEL"
for p in cpu-moe all-gpu cpu; do
    "$PY" bench/gpu_profile.py -m "$MODEL" --placement "$p" --steps 12 --ctx 512 --top 15 --json "$OUTDIR/gpu_profile-$p.json" \
        2>&1 | tee "$OUTDIR/gpu_profile-$p.log" || echo "gpu_profile $p failed"
done
