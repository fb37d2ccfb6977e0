"""What an output folder holds, in either format: every complete output with its record and location.

Read by `manifest`, `status`, `report` and `export`. Only finalized files count (a sidecar is renamed into
place last; a shard is read through its index once renamed), so reading beside a running job is safe.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from cosmos3_batch.io import dataset
from cosmos3_batch.io.metrics import STATE_DIR
from cosmos3_batch.io.outputs import sidecar_stamp
from cosmos3_batch.io.shard_index import Located, latest_samples, read_indexes

MEDIA_SUFFIXES = ("png", "mp4")


@dataclass(frozen=True)
class Output:
    id: str
    record: dict  # the sidecar (files) or the shard index's entry (webdataset): request, kind, seed, timings
    path: str  # relative to OUT: the media file, or the shard that holds the sample
    member: str | None  # webdataset: the media member of the sample
    finished: float  # Unix time it became final: the sidecar's mtime, the shard's finalization
    located: Located | None = None  # webdataset: where its members are
    stamp: tuple[str, int, int] | None = None  # files: the sidecar's mtime, inode, size (sidecar_stamp)

    def read(self, out: Path, suffix: str) -> bytes:
        """A member's bytes (webdataset) or the file `<id>.<suffix>` beside the media (files)."""
        if self.located is not None:
            return self.located.read(out, suffix)
        return (out / self.path).with_name(f"{self.id}.{suffix}").read_bytes()

    def has(self, suffix: str) -> bool:
        if self.located is not None:
            return suffix in self.located.sample["members"]
        files = (self.record.get("files") or {}).values()
        return f"{self.id}.{suffix}" in {entry.get("name") for entry in files if isinstance(entry, dict)}


def require_run(out: Path) -> None:
    """ValueError unless a run has written to OUT (for `status` and `manifest`: said, not reported empty)."""
    if not (out / STATE_DIR).is_dir():
        raise ValueError(f"{out}: no run has written here (no {STATE_DIR}/ folder)")


def complete_outputs(
    out: Path, known: Callable[[str, tuple], bool] | None = None, indexes: list[dict] | None = None
) -> dict[str, Output]:
    """Request id -> its complete output, in the format OUT was written in. `known(id, stamp)`: True for a
    sidecar the caller already has a record of as of that `outputs.sidecar_stamp` (files format): it is not
    read, and not returned. `indexes`: the shard indexes (webdataset), when the caller has just read them."""
    held = dataset.of(out)
    if held.format == "webdataset":
        return _shard_outputs(read_indexes(out) if indexes is None else indexes)
    return _file_outputs(out, held.layout, known)


def _shard_outputs(indexes: list[dict]) -> dict[str, Output]:
    found = {}
    for rid, loc in latest_samples(indexes).items():
        media = _media_member(loc.sample)
        finished = datetime.fromisoformat(loc.finalized_at).timestamp()
        found[rid] = Output(rid, loc.sample, loc.shard, loc.member(media), finished, loc)
    return found


def _media_member(sample: dict) -> str:
    """The suffix of a sample's output: a reasoner's is its text, `txt` (a generation sample's `txt` is its
    prompt, beside the PNG or MP4)."""
    if sample.get("kind") == "reason":
        return "txt"
    return next((s for s in sample["members"] if s in MEDIA_SUFFIXES), "")


def _file_outputs(out: Path, layout: str, known: Callable[[str, tuple], bool] | None) -> dict[str, Output]:
    folders = [out] if layout == "flat" else sorted(p for p in out.glob("[0-9a-f][0-9a-f]") if p.is_dir())
    found = {}
    for folder in folders:
        with os.scandir(folder) as entries:
            names = [e.name for e in entries if e.name.endswith(".json") and not e.name.startswith(".")]
        for name in names:
            try:
                st = (folder / name).stat()
            except OSError:
                continue
            if known is not None and known(name.removesuffix(".json"), sidecar_stamp(st)):
                continue
            sidecar = _sidecar(folder / name)
            if sidecar is None or name != f"{sidecar['id']}.json":
                continue
            media = str((sidecar.get("files") or {}).get("media", {}).get("name", ""))
            if not media or Path(media).name != media:
                continue  # never a path out of OUT
            where = folder.relative_to(out) / media
            found[sidecar["id"]] = Output(sidecar["id"], sidecar, str(where), None, st.st_mtime, None,
                                          sidecar_stamp(st))  # fmt: skip
    return found


def _sidecar(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("status") != "complete" or not isinstance(data.get("id"), str):
        return None  # summary.json, <id>.actions.json, anything not ours
    return data
