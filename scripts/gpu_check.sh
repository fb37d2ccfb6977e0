#!/usr/bin/env bash
# One-GPU check of the design's numbers (H2D GB/s pageable vs pinned, GEN-layer compute at 480p/720p token
# counts, local/allgather vs resident overlap, K=1 vs K=4, stall share from CUDA events, peak device
# memory) on Nano-shaped layers with random bf16 weights; then two ranks on the one GPU through gloo
# against one process, host-device syncs per pass and the batched row budget at 720p (gpu/multi_rank.py);
# then issue 48's findings on real jobs (gpu/review_two.py: the decode team on gloo beside the loop,
# SeaCache decisions in an --sp group, device timings drained at the end, a stalled peer's exit line);
# then tests/gpu. Nothing is downloaded. Fits in 10 minutes on one H200; prints markdown tables for
# docs/benchmarks.md.
#
#   bash scripts/gpu_check.sh [--layers 8] [--tmp DIR] [--out gpu_check.md]
#
# Python: $PYTHON if set, else .venv/bin/python if it exists, else python3. It needs a CUDA build of torch.
# Packages that image lacks (diffusers, imageio-ffmpeg, this project): when .whl/ holds wheels (made here by
# `python scripts/gpu/fetch_wheels.py`), they are installed into $COSMOS3_GPU_SITE first, no network.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
START=$SECONDS
TOTAL_S=590  # the whole check, tests included, stays under 10 minutes
if [ -n "${PYTHON:-}" ]; then
  py="$PYTHON"
elif [ -x "$ROOT/.venv/bin/python" ]; then
  py="$ROOT/.venv/bin/python"
else
  py="python3"
fi
export COSMOS3_BATCH_CACHE="${COSMOS3_BATCH_CACHE:-/tmp/cosmos3-batch-cache}"
if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA device is visible to $py (torch $("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo missing)); this check needs one NVIDIA GPU and a CUDA build of torch" >&2
  exit 2
fi
# torch is the image's own (checked above); what it lacks comes from the carried wheels.
site="${COSMOS3_GPU_SITE:-/tmp/cosmos3-site}"
if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
  "$py" "$ROOT/scripts/gpu/fetch_wheels.py" --dest "$ROOT/.whl" --install "$site" >/dev/null
  # The working tree first (it is what we check), then the carried wheels, then the image's packages.
  export PYTHONPATH="$ROOT:$site${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
# The single-process measurements get 250 s (the Python side stops starting sections at --budget-s; the
# shell kills it at 260 s whatever happens, and tables already printed stay printed); the multi-rank ones
# (two ranks on this one GPU through gloo, syncs per pass, the row budget at 720p) 120 s; tests/gpu gets
# what is left.
status=0
timeout --signal=TERM --kill-after=10 260 "$py" "$ROOT/scripts/gpu/check.py" --budget-s 220 "$@" || status=$?
timeout --signal=TERM --kill-after=10 120 "$py" "$ROOT/scripts/gpu/multi_rank.py" --device cuda:0 || status=$?
timeout --signal=TERM --kill-after=10 120 "$py" "$ROOT/scripts/gpu/review_two.py" --device cuda:0 || status=$?
left=$((TOTAL_S - (SECONDS - START)))
echo
echo "### tests/gpu"
echo
if [ "$left" -lt 60 ]; then
  echo "| result |"
  echo "|---|"
  echo "| not run: ${left} s left of the 10-minute budget |"
  exit "$status"
fi
log="$(mktemp)"
tests=0
(cd "$ROOT" && timeout --signal=TERM --kill-after=10 "$left" "$py" -m pytest -q -p no:cacheprovider tests/gpu) >"$log" 2>&1 || tests=$?
summary="$(grep -E '(passed|failed|error|skipped)' "$log" | tail -1 || true)"
echo "| result | exit |"
echo "|---|---|"
echo "| ${summary:-no pytest summary (timed out after ${left} s?)} | $tests |"
if [ "$tests" -ne 0 ]; then
  tail -n 40 "$log" >&2
fi
rm -f "$log"
[ "$status" -ne 0 ] && exit "$status"
exit "$tests"
