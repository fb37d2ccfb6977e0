#!/usr/bin/env bash
# Newcomer's first command: install into .venv, then generate examples/prompts.jsonl with the built-in
# tiny model (created locally on first use; nothing is downloaded). Outputs land in out/demo/.
# Then the sound and action modes (examples/modes.jsonl) on a tiny model that has them -> out/demo-modes/.
source "$(dirname "$0")/env.sh" run
python -m cosmos3_batch run examples/prompts.jsonl --out out/demo "$@"
MODES_MODEL="${COSMOS3_BATCH_CACHE:-$HOME/.cache/cosmos3_batch}/demo-sound-action"
if [ ! -f "$MODES_MODEL/model_index.json" ]; then
  python -m cosmos3_batch make-tiny "$MODES_MODEL" --sound --action
fi
python -m cosmos3_batch run examples/modes.jsonl --model "$MODES_MODEL" --out out/demo-modes "$@"
