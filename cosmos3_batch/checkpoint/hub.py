"""`--model`: a checkpoint folder, or a Hugging Face repo id `ORG/NAME[@REVISION]` resolved to a snapshot in
the local cache (DESIGN.md §13), before anything loads.

Offline (`HF_HUB_OFFLINE=1`, what clusters and the tests set) only the cache is read; online a missing
snapshot is downloaded by huggingface_hub itself. The commit of the snapshot is recorded with every output,
so an output names the exact weights even when the repo moves on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from cosmos3_batch.checkpoint.declared import INDEX, MODULAR_INDEX

_REPO_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")


@dataclass(frozen=True)
class ModelSource:
    """Where the checkpoint came from: its folder and, for a repo id, the repo, revision and commit."""

    path: Path
    repo: str | None = None
    revision: str | None = None
    commit: str | None = None

    def record(self) -> dict:
        """What sidecars and the summary say about the model."""
        hub = {"model_repo": self.repo, "model_revision": self.revision, "model_commit": self.commit}
        return {"model": str(self.path), **(hub if self.repo else {})}


def resolve_model(text: str) -> ModelSource:
    """A folder holding model_index.json (or a modular one), or a repo id found in (or, online, fetched
    into) the HF cache. ValueError names what is wrong and how to fix it."""
    folder = Path(text).expanduser()
    if folder.is_dir():
        if not _has_index(folder):
            raise ValueError(
                f"--model {text}: not a diffusers checkpoint folder (no {INDEX} nor {MODULAR_INDEX})"
            )
        return ModelSource(folder.resolve())
    match = _REPO_ID.fullmatch(text)
    if match is None or folder.exists():
        raise ValueError(f"--model {text}: not a checkpoint folder nor a Hugging Face repo id ORG/NAME[@REV]")
    try:
        return _from_hub(match["repo"], match["revision"] or "main")
    except ValueError as exc:  # a mistyped relative path reads as a repo id: say both
        raise ValueError(f"{exc} (and no folder {folder.resolve()} exists)") from None


def _from_hub(repo: str, revision: str) -> ModelSource:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = constants.HF_HUB_OFFLINE
    try:
        path = Path(snapshot_download(repo, revision=revision, local_files_only=offline))
    except LocalEntryNotFoundError:
        where = "offline (HF_HUB_OFFLINE=1): " if offline else ""
        raise ValueError(
            # `hf`: the command huggingface_hub >= 1.0 installs (it no longer ships `huggingface-cli`).
            f"--model {repo}@{revision}: {where}not in the Hugging Face cache {constants.HF_HUB_CACHE}; "
            f"download it first: hf download {repo} --revision {revision}"
        ) from None
    except Exception as exc:  # no such repo, no access, a network error with nothing cached
        raise ValueError(f"--model {repo}@{revision}: {type(exc).__name__}: {exc}") from None
    if not _has_index(path):
        raise ValueError(f"--model {repo}@{revision}: snapshot {path} is not a diffusers checkpoint")
    return ModelSource(path, repo, revision, commit=path.name)  # snapshots/<commit>


def _has_index(folder: Path) -> bool:
    """A pipeline folder (model_index.json) or a modular one (modular_model_index.json: distilled)."""
    return (folder / INDEX).is_file() or (folder / MODULAR_INDEX).is_file()
