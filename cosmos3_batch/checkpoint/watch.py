"""The checkpoint's files are fixed for the job's life: what they were at load, checked every pass.

A checkpoint rewritten in place under a running job (`cp new.safetensors model.safetensors`) changes the
bytes behind our memory maps: the job would go on producing outputs from a mix of two models, and a
truncation turns reads of the mapping into SIGBUS. One `os.stat` per file per pass (microseconds) notices
any change of device, inode, size or modification time. Replacing a checkpoint by rename is atomic for new
jobs, and a running one stops as well: its outputs would be recorded under a path that now names another
model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FileStamp:
    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileStamp:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class CheckpointWatch:
    def __init__(self, root: str | Path):
        """Stamp every file of the checkpoint folder now (before anything is read from it)."""
        self.root = Path(root)
        self.stamps: dict[Path, FileStamp] = {}
        for path in sorted(self.root.rglob("*")):
            if (
                any(part.startswith(".") for part in path.relative_to(self.root).parts)
                or path.suffix == ".lock"
            ):
                continue  # a downloader's locks and metadata (.cache/), NFS's .nfsXXXX: not the model's files
            try:
                if path.is_file():  # follows a cache snapshot's symlinks to the blobs they name
                    self.stamps[path] = FileStamp.of(path.stat())
            except OSError:
                continue  # vanished between the listing and the stat: not a file the job reads

    def changed(self) -> str | None:
        """None while every file is as it was; else one line naming the first file that is not."""
        for path, was in self.stamps.items():
            try:
                now = FileStamp.of(path.stat())
            except OSError as exc:
                return f"checkpoint file {path} is gone ({exc.strerror or exc})"
            if now != was:
                return f"checkpoint file {path} changed during the job ({_difference(was, now)})"
        return None


def _difference(was: FileStamp, now: FileStamp) -> str:
    if (was.device, was.inode) != (now.device, now.inode):
        return "replaced by another file"
    if was.size != now.size:
        return f"size {was.size} -> {now.size} bytes: rewritten in place"
    return "modified in place"
