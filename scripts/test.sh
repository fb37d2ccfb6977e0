#!/usr/bin/env bash
# Installs into .venv (with the dev extras: pytest, ruff, accelerate for the reference pipeline), then
# lints and runs every test tier that this machine can run (GPU tests skip without CUDA).
source "$(dirname "$0")/env.sh" dev "[dev]"
ruff check cosmos3_batch tests scripts
ruff format --check cosmos3_batch tests scripts
python -m pytest -q "$@"
