# Sourced by demo.sh and test.sh: make (or reuse) .venv with pinned torch and this project installed.
# torch is pinned because an unpinned install pulls a multi-GB CUDA build; 2.13.0 is what we test against.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${COSMOS3_BATCH_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3.11}"
say() { echo "[set-up] $*" >&2; }
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV ($PYTHON)"
  "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
stamp="$VENV/.installed-$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)-${1:-run}"
if [ ! -f "$stamp" ]; then
  say "installing torch 2.13.0 (first time: ~30 s from a local wheel, minutes from the registry)"
  python -m pip install -q --disable-pip-version-check "torch==2.13.0"
  say "installing cosmos3_batch and its packages (diffusers, transformers, imageio-ffmpeg, ...${2:+ and dev tools})"
  python -m pip install -q --disable-pip-version-check -e "$ROOT${2:-}"
  touch "$stamp"
  say "done: $VENV"
fi
cd "$ROOT"
