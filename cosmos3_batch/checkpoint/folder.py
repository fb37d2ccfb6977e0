"""A diffusers checkpoint folder: its components, configs, tensor stores and identity."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from cosmos3_batch.checkpoint.declared import (
    INDEX,
    MODULAR_INDEX,
    DeclarationError,
    Sampler,
    component_index,
    declared_sampler,
    read_indexes,
)
from cosmos3_batch.checkpoint.reader import CheckpointFileError, TensorStore

COMPONENTS = ("transformer", "vae", "scheduler", "text_tokenizer")


class CheckpointError(ValueError):
    """The checkpoint folder is missing a part or disagrees with its own config."""


@dataclass
class Checkpoint:
    root: Path
    model_index: dict  # model_index.json, or the component view of a modular-only folder's index
    modular_index: dict | None = None  # modular_model_index.json where the folder has one

    @classmethod
    def open(cls, root: str | Path) -> Checkpoint:
        root = Path(root)
        index, modular = read_indexes(root)
        if index is None and modular is None:
            raise CheckpointError(f"{root}: not a diffusers checkpoint (no {INDEX} nor {MODULAR_INDEX})")
        for name in COMPONENTS:
            if not (root / name).is_dir():
                raise CheckpointError(f"{root}: component folder '{name}/' is missing")
        return cls(root, component_index(index, modular), modular)

    @property
    def sampler(self) -> Sampler:
        """The sampler the folder declares (checkpoint/declared.py); CheckpointError for one not run."""
        try:
            return declared_sampler(self.root, self.modular_index, self.config("scheduler"))
        except DeclarationError as exc:
            raise CheckpointError(str(exc)) from None

    @property
    def default_use_system_prompt(self) -> bool:
        """The pipeline config's default (a modular index's where the folder has one, as the modular
        pipeline reads it)."""
        source = self.modular_index if self.modular_index is not None else self.model_index
        return bool(source.get("default_use_system_prompt", True))

    def identity(self) -> str:
        """Changes when the model would produce different outputs: its configs and weight files (name and
        size), not where it lives, so a moved checkpoint still resumes. Every component folder counts, as
        it always has (outputs written by earlier versions keep resuming); a modular index counts too."""
        digest = hashlib.sha256()
        indexes = [self.root / name for name in (INDEX, MODULAR_INDEX) if (self.root / name).is_file()]
        for path in [*sorted(self.root.glob("*/*.json")), *indexes]:
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
