"""Where the trained demo model's weights go (cosmos3_batch/model/trained_tiny/, not shipped yet) and what is
recorded beside them: its shape, its model_index.json, the digests of its files."""

from __future__ import annotations

import hashlib
from pathlib import Path

from cosmos3_batch.model.tiny import TinySpec, model_index

SHIPPED = Path(__file__).resolve().parents[1] / "trained_tiny"
RECORD = "demo_model.json"  # beside the weights: the command that made them, their digests, the accuracy
COMPONENTS = ("transformer", "vae", "scheduler", "text_tokenizer")

# The demo model's shape: 4 layers of hidden 128 (1.7 M parameters, 7 MB in float32) read a prompt of bytes
# well enough for this grammar and train in minutes on two CPU cores.
DEMO_SPEC = TinySpec(layers=4, hidden=128, heads=4, kv_heads=2, intermediate=384, vae_dim=8, flow_shift=3.0)


def demo_model_index() -> dict:
    index = model_index(DEMO_SPEC)
    # Trained without the reference's system prompt: it would add ~75 tokens to every sequence and say
    # nothing the grammar needs. The reference pipeline reads this default, so a request gets the same.
    index["default_use_system_prompt"] = False
    return index


def file_digests(folder: Path) -> dict[str, str]:
    """sha256 of every file of the components, by path relative to `folder`."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for name in COMPONENTS
        for p in sorted((folder / name).rglob("*"))
        if p.is_file()
    }


def combined_digest(digests: dict[str, str]) -> str:
    """One sha256 for the whole model: of the sorted `digest  path` lines, as `sha256sum` prints them."""
    lines = "".join(f"{digest}  {path}\n" for path, digest in sorted(digests.items()))
    return hashlib.sha256(lines.encode()).hexdigest()
