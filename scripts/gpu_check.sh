#!/usr/bin/env bash
# One-GPU check of the design's numbers (H2D GB/s pageable vs pinned, GEN-layer compute at 480p/720p token
# counts, local/allgather vs resident overlap, K=1 vs K=4) on Nano-shaped layers with random bf16 weights.
# Nothing is downloaded. Fits in 8 minutes on one H200; prints markdown tables to paste into the README.
#
#   bash scripts/gpu_check.sh [--layers 8] [--tmp DIR] [--out gpu_check.md]
#
# Python: $PYTHON if set, else .venv/bin/python if it exists, else python3. It needs a CUDA build of torch.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -n "${PYTHON:-}" ]; then
  py="$PYTHON"
elif [ -x "$ROOT/.venv/bin/python" ]; then
  py="$ROOT/.venv/bin/python"
else
  py="python3"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA device is visible to $py (torch $("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo missing)); this check needs one NVIDIA GPU and a CUDA build of torch" >&2
  exit 2
fi
# The whole check stays inside 8 minutes: the Python side stops starting sections at --budget-s, and the
# shell kills it at 480 s whatever happens (tables already printed stay printed).
exec timeout --signal=TERM --kill-after=10 480 "$py" "$ROOT/scripts/gpu_check.py" --budget-s 420 "$@"
