"""A diffusers checkpoint folder: its components, configs, tensor stores and identity."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from cosmos3_batch.checkpoint.reader import CheckpointFileError, TensorStore

COMPONENTS = ("transformer", "vae", "scheduler", "text_tokenizer")


class CheckpointError(ValueError):
    """The checkpoint folder is missing a part or disagrees with its own config."""


@dataclass
class Checkpoint:
    root: Path
    model_index: dict

    @classmethod
    def open(cls, root: str | Path) -> Checkpoint:
        root = Path(root)
        index = root / "model_index.json"
        if not index.is_file():
            raise CheckpointError(f"{root}: not a diffusers checkpoint (no model_index.json)")
        for name in COMPONENTS:
            if not (root / name).is_dir():
                raise CheckpointError(f"{root}: component folder '{name}/' is missing")
        return cls(root, json.loads(index.read_text()))

    def identity(self) -> str:
        """Changes when the model would produce different outputs: its configs and weight files (name and
        size), not where it lives, so a moved checkpoint still resumes."""
        digest = hashlib.sha256()
        for path in [*sorted(self.root.glob("*/*.json")), self.root / "model_index.json"]:
            digest.update(f"{path.relative_to(self.root)}\n".encode() + path.read_bytes())
        for path in sorted(self.root.glob("*/*.safetensors")):
            digest.update(f"{path.relative_to(self.root)}:{path.stat().st_size}\n".encode())
        return digest.hexdigest()[:16]

    def config(self, component: str) -> dict:
        name = "scheduler_config.json" if component == "scheduler" else "config.json"
        return json.loads((self.root / component / name).read_text())

    def store(self, component: str) -> TensorStore:
        """Memory-mapped, header-checked tensors of one component (sharded via the index JSON or not)."""
        try:
            return TensorStore(self.root / component)
        except CheckpointFileError as exc:
            raise CheckpointError(str(exc)) from exc
