#!/usr/bin/env bash
# Newcomer's first command: install into .venv, then generate examples/prompts.jsonl with the built-in
# tiny model (created locally on first use; nothing is downloaded). Outputs land in out/demo/.
source "$(dirname "$0")/env.sh" run
python -m cosmos3_batch run examples/prompts.jsonl --out out/demo "$@"
