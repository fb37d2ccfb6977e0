#!/usr/bin/env bash
# Installs .venv (torch and the project: the jobs the tests start run there, as a user's would) and .venv-dev
# (the same plus the dev extras: pytest, ruff, accelerate for the reference pipeline, ...; scripts/env.sh),
# lints, then:
#   bash scripts/test.sh            every test tier this machine can run (GPU tests skip without CUDA), on two
#                                   pytest-xdist workers (worksteal: an idle worker takes tests from a busy one), and
#                                   the exactness tests (marker `exact`) once more under a lower instruction
#                                   set, so an assumption that holds on one CPU only fails here, not for a user
#   bash scripts/test.sh --quick    lint + the unit tier without its torchrun-launching tests: the dev loop
#   bash scripts/test.sh ARGS...    lint + pytest ARGS (e.g. tests/dist -k resume)
# Beside the main tier, at the lowest CPU priority (nice 19: they take the cores only when the main tier leaves
# them idle, as its tests wait on timeouts, signals and their own processes' start): the exactness rerun, and the
# guardrail tier (tests/guardrails) in its own virtualenv, .venv-guardrails, set up first: it needs a torchvision
# that works, which needs the CUDA build of torch (README "Tests", scripts/env.sh). Their logs' last lines are
# printed once the main tier is done (a whole log where that run failed).
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
side="" guard="" exact=""
# A failed step ends the side runs too; their folders go either way (a failed run's log is printed first).
trap 'kill $exact $guard 2>/dev/null || true; [ -z "$side" ] || rm -rf "$side"' EXIT
if [ $# -eq 0 ]; then
  side="$(mktemp -d)"  # the side runs' logs and pytest folders (apart from the main tier's)
  exact_log="$side/exact.log" guard_log="$side/guardrails.log"
  # The guardrail tier first of all: its virtualenv's set-up (about 30 s of wall, a minute of CPU) needs
  # nothing of .venv's, and the set-up below leaves a core idle while pip unpacks torch.
  # One pytest process, as for the exactness rerun below: a second worker cost its own imports, collection and
  # fixtures (measured alone: 61 CPU-s on two workers, 47 on one, in about the same wall time).
  nice -n 19 bash -c "source '$ROOT/scripts/env.sh' guardrails && python -m pytest -q -p no:cacheprovider \
    --basetemp '$side/guardrails' tests/guardrails" >"$guard_log" 2>&1 &
  guard=$!
fi
source "$ROOT/scripts/env.sh" dev
ruff check cosmos3_batch tests scripts
ruff format --check cosmos3_batch tests scripts
if [ "${1:-}" = "--quick" ]; then
  shift
  exec python -m pytest -q -n 2 --dist worksteal -m "not dist" tests/unit "$@"
fi
if [ $# -gt 0 ]; then
  exec python -m pytest -q "$@"
fi
# One step below what this CPU runs by default: AVX512 -> AVX2, AVX2 (or less) -> AVX, for MKL, ATen's
# portable kernels and oneDNN, each reading its variable once at start. oneDNN goes down with ATen: torch's
# CPU flash attention asks oneDNN whether bf16 weights need VNNI packing (yes where the CPU has AMX), then
# calls a packing routine that only its AVX512 build has ("pack_vnni2 is only supported when avx512 is
# supported" from scaled_dot_product_attention under ATEN_CPU_CAPABILITY=avx2 on a Sapphire Rapids Xeon).
read -r mkl_isa aten_isa onednn_isa < <(python -c "
import torch
print('AVX2 avx2 AVX2' if torch.backends.cpu.get_cpu_capability().startswith('AVX512') else 'AVX default AVX')")
lower="MKL_ENABLE_INSTRUCTIONS=$mkl_isa ATEN_CPU_CAPABILITY=$aten_isa ONEDNN_MAX_CPU_ISA=$onednn_isa"
# The in-process tier's `exact` tests: only the modules that hold them are collected (collecting every module
# costs about 11 CPU-s), in one pytest process, since it runs beside the main tier on what CPU that leaves. The
# one `exact` test under tests/dist, test_sp's grids, stays in the main tier: the CPU facts its shards rest on
# (a GEMM row's bits whatever the call's row count from 16 rows on, Ulysses attention equal to the unsplit
# call, the split VAE walk) are asserted here in process (test_sequence_parallel, test_vae_patch), and its two
# launches and references were about 70 of the rerun's 3 CPU-min (docs/testing.md).
mapfile -t exact_modules < <(grep -rlE --include='test_*.py' 'mark\.exact' tests/unit | sort)
env $lower nice -n 19 python -m pytest -q -p no:cacheprovider -m exact --basetemp "$side/exact" "${exact_modules[@]}" \
  >"$exact_log" 2>&1 &
exact=$!
python -m pytest -q -n 2 --dist worksteal
echo "[test] the exactness tests again with $lower (run beside the main tier)"
wait "$exact" || { cat "$exact_log"; echo "[test] the exactness rerun failed" >&2; exit 1; }
tail -n 1 "$exact_log"
echo "[test] the guardrail tier in its own virtualenv, .venv-guardrails (set up and run beside the main tier)"
wait "$guard" || { cat "$guard_log"; echo "[test] the guardrail tier failed" >&2; exit 1; }
tail -n 1 "$guard_log"
