"""The demo model (issue 26, not shipped yet: docs/demo-model.md): its visual grammar, the judge that reads a
picture back into the grammar, and the training recipe `scripts/train_tiny.py` runs."""
