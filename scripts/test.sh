#!/usr/bin/env bash
# Installs into .venv (with the dev extras: pytest, ruff, accelerate for the reference pipeline), lints, then:
#   bash scripts/test.sh            every test tier this machine can run (GPU tests skip without CUDA), on two
#                                   pytest-xdist workers (worksteal: an idle worker takes tests from a busy one), then
#                                   the exactness tests (marker `exact`) once more under a lower instruction
#                                   set, so an assumption that holds on one CPU only fails here, not for a user
#   bash scripts/test.sh --quick    lint + the unit tier without its torchrun-launching tests: the dev loop
#   bash scripts/test.sh ARGS...    lint + pytest ARGS (e.g. tests/dist -k resume)
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
python -m pytest -q -n 2 --dist worksteal
# One step below what this CPU runs by default: AVX512 -> AVX2, AVX2 (or less) -> AVX for MKL and ATen's
# portable kernels. MKL reads MKL_ENABLE_INSTRUCTIONS, ATen ATEN_CPU_CAPABILITY, each once at start.
read -r mkl_isa aten_isa < <(python -c "
import torch
print('AVX2 avx2' if torch.backends.cpu.get_cpu_capability().startswith('AVX512') else 'AVX default')")
echo "[test] the exactness tests again with MKL_ENABLE_INSTRUCTIONS=$mkl_isa ATEN_CPU_CAPABILITY=$aten_isa"
MKL_ENABLE_INSTRUCTIONS=$mkl_isa ATEN_CPU_CAPABILITY=$aten_isa python -m pytest -q -n 2 --dist worksteal -m exact
