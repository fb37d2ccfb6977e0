#!/usr/bin/env bash
# Newcomer's first command: install into .venv, then
# 1. the trained demo model (shipped with the package, written to the cache by make-tiny --trained) draws
#    the shapes of examples/shapes.jsonl -> out/demo-shapes/, with its report.html;
# 2. examples/prompts.jsonl on the built-in tiny model (random weights: noise by design) -> out/demo/;
# 3. the sound and action modes (examples/modes.jsonl) on a tiny model that has them -> out/demo-modes/;
# 4. Transfer (examples/transfer.jsonl: controls derived from examples/clip.mp4) on the built-in tiny model
#    -> out/demo-transfer/;
# 5. the reasoner (examples/reason.jsonl: text and an image in, text out) on a tiny model that has one
#    -> out/demo-reason/ (<id>.txt);
# 6. a dataset job end to end (examples/dataset.jsonl: short prompts upsampled by that reasoner, outputs
#    captioned and scored by it; docs/chain.md) -> out/demo-dataset/ (manifest.parquet holds both prompts).
# Nothing is downloaded.
source "$(dirname "$0")/env.sh" run
CACHE="${COSMOS3_BATCH_CACHE:-$HOME/.cache/cosmos3_batch}"
# One folder per shipped model (its digest), so a newer checkout never reuses an older model's copy.
DIGEST=$(python -c 'import json; print(json.load(open("cosmos3_batch/model/trained_tiny/demo_model.json"))["digest"][:12])')
DEMO_MODEL="$CACHE/demo-shapes-$DIGEST"
if [ ! -f "$DEMO_MODEL/model_index.json" ]; then
  python -m cosmos3_batch make-tiny "$DEMO_MODEL" --trained
fi
python -m cosmos3_batch run examples/shapes.jsonl --model "$DEMO_MODEL" --out out/demo-shapes "$@"
python -m cosmos3_batch report out/demo-shapes
python -m cosmos3_batch run examples/prompts.jsonl --out out/demo "$@"
MODES_MODEL="$CACHE/demo-sound-action"
if [ ! -f "$MODES_MODEL/model_index.json" ]; then
  python -m cosmos3_batch make-tiny "$MODES_MODEL" --sound --action
fi
python -m cosmos3_batch run examples/modes.jsonl --model "$MODES_MODEL" --out out/demo-modes "$@"
python -m cosmos3_batch run examples/transfer.jsonl --out out/demo-transfer "$@"
REASON_MODEL="$CACHE/demo-reasoner"
if [ ! -f "$REASON_MODEL/model_index.json" ]; then
  python -m cosmos3_batch make-tiny "$REASON_MODEL" --reasoner
fi
python -m cosmos3_batch run examples/reason.jsonl --model "$REASON_MODEL" --out out/demo-reason "$@"
# Random weights write no JSON object: the text format takes the reply as it is.
python -m cosmos3_batch run examples/dataset.jsonl --model "$REASON_MODEL" --out out/demo-dataset \
  --upsample-format text --upsample-max-new-tokens 48 --caption-max-new-tokens 24 "$@"
echo "The demo model's shapes: open $(pwd)/out/demo-shapes/report.html in a browser (docs/demo-model.md)."
