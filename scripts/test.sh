#!/usr/bin/env bash
# Installs into .venv (with the dev extras: pytest, ruff, accelerate for the reference pipeline), lints, then:
#   bash scripts/test.sh            every test tier this machine can run (GPU tests skip without CUDA), on two
#                                   pytest-xdist workers (worksteal: an idle worker takes tests from a busy one), then
#                                   the exactness tests (marker `exact`) once more under a lower instruction
#                                   set, so an assumption that holds on one CPU only fails here, not for a user
#   bash scripts/test.sh --quick    lint + the unit tier without its torchrun-launching tests: the dev loop
#   bash scripts/test.sh ARGS...    lint + pytest ARGS (e.g. tests/dist -k resume)
# The full run ends with the guardrail tier (tests/guardrails) in its own virtualenv, .venv-guardrails (set up in
# the background while the main tier runs): it needs a torchvision that works, which needs the CUDA build of
# torch (README "Tests", scripts/env.sh).
source "$(dirname "$0")/env.sh" dev "[dev]"
ruff check cosmos3_batch tests scripts
ruff format --check cosmos3_batch tests scripts
if [ "${1:-}" = "--quick" ]; then
  shift
  exec python -m pytest -q -n 2 --dist worksteal -m "not dist" tests/unit "$@"
fi
if [ $# -gt 0 ]; then
  exec python -m pytest -q "$@"
fi
# The guardrail tier's virtualenv is set up meanwhile (mostly downloads: it waits on the network, not the CPU);
# its log is printed if it fails.
guard_log="$ROOT/.venv-guardrails.log"
COSMOS3_BATCH_NO_APT=1 bash -c "source '$ROOT/scripts/env.sh' guardrails" >"$guard_log" 2>&1 &
guard_setup=$!
trap 'kill "$guard_setup" 2>/dev/null || true' EXIT  # a failed tier above ends the set-up too
python -m pytest -q -n 2 --dist worksteal
# One step below what this CPU runs by default: AVX512 -> AVX2, AVX2 (or less) -> AVX, for MKL, ATen's
# portable kernels and oneDNN, each reading its variable once at start. oneDNN goes down with ATen: torch's
# CPU flash attention asks oneDNN whether bf16 weights need VNNI packing (yes where the CPU has AMX), then
# calls a packing routine that only its AVX512 build has ("pack_vnni2 is only supported when avx512 is
# supported" from scaled_dot_product_attention under ATEN_CPU_CAPABILITY=avx2 on a Sapphire Rapids Xeon).
read -r mkl_isa aten_isa onednn_isa < <(python -c "
import torch
print('AVX2 avx2 AVX2' if torch.backends.cpu.get_cpu_capability().startswith('AVX512') else 'AVX default AVX')")
lower="MKL_ENABLE_INSTRUCTIONS=$mkl_isa ATEN_CPU_CAPABILITY=$aten_isa ONEDNN_MAX_CPU_ISA=$onednn_isa"
echo "[test] the exactness tests again with $lower"
env $lower python -m pytest -q -n 2 --dist worksteal -m exact
echo "[test] the guardrail tier in its own virtualenv (scripts/env.sh guardrails, set up beside the tests)"
wait "$guard_setup" || { cat "$guard_log"; echo "[test] setting up .venv-guardrails failed" >&2; exit 1; }
(source "$ROOT/scripts/env.sh" guardrails && python -m pytest -q -n 2 --dist worksteal tests/guardrails)
