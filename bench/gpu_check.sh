#!/usr/bin/env bash
# One-shot GPU check (one CUDA GPU, no network): build the kernels, write a 20b-shaped synthetic
# model, compare GPU logits with CPU logits, then print pp512 / tg128 tokens/s and peak VRAM for
# --cpu-moe, --n-cpu-moe 12 and all-on-GPU, and profile decode steps (bench/gpu_profile.py).
# Target: under 8 minutes on one H200 + 16 cores (2026-12-04: 3 minutes before the profile).
# Without CUDA it skips the GPU rows (saying so) and smoke-tests itself on the tiny preset.
#
#   bench/gpu_check.sh [--preset 20b] [--ctx 4096] [--json out.json]   (PYTHON=... to pick the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! "$PY" -c "import torch, numpy" 2>/dev/null; then
    echo "gpu_check: $PY lacks torch/numpy; point PYTHON at an environment that has them" >&2
    exit 2
fi

# Build: compile csrc/ into the package (offline: no dependency resolution, no build isolation).
# Skipped when the package imports and its kernel library loads (GPU_CHECK_REBUILD=1 forces it),
# so a shared checkout's library is not rebuilt under other users' feet.
if [ "${GPU_CHECK_REBUILD:-0}" != "0" ] || ! PYTHONPATH=src "$PY" -c \
        "import sys; from hybridmoe import kernels; sys.exit(0 if kernels.available() else 1)" 2>/dev/null; then
    echo "[gpu_check] building with $PY"
    if ! "$PY" -m pip install -q -e . --no-deps --no-build-isolation; then
        echo "[gpu_check] pip install failed; building the extension in place" >&2
        "$PY" setup.py -q build_ext --inplace
    fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "from hybridmoe import kernels; print('[gpu_check] kernels:', kernels.isa())"

# CPU threads: all cores unless the caller pinned OMP_NUM_THREADS (shared dev machines do).
THREADS="${OMP_NUM_THREADS:-$(nproc)}"
export OMP_NUM_THREADS="$THREADS"
rc=0
timeout "${GPU_CHECK_TIMEOUT:-470}" "$PY" bench/gpu_check.py --threads "$THREADS" "$@" || rc=$?
# Then where a decode step's time goes (bench/gpu_profile.py) on the same 20b file, ~1 minute;
# GPU_CHECK_PROFILE=0 skips it. Only with CUDA and the file gpu_check.py wrote.
MODEL=bench/out/synth-20b.gguf
if [ "${GPU_CHECK_PROFILE:-1}" != "0" ] && [ -f "$MODEL" ] && "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    for p in cpu-moe all-gpu; do
        timeout 120 "$PY" bench/gpu_profile.py -m "$MODEL" --placement "$p" --threads "$THREADS" --steps 8 --ctx 512 \
            --top 12 || echo "[gpu_check] gpu_profile $p failed"
    done
fi
exit $rc
