"""`--format webdataset`: each rank appends its finished samples to tar shards (DESIGN.md §12).

A sample is one request: its members `<key>.<ext>` (media, `.json` sidecar, `.txt` prompt, and `.wav`,
`.actions.safetensors`, `.latents.safetensors` where they exist; a reasoner request's `.txt` is its generated
text and `.prompt.txt` its prompt), grouped by basename as WebDataset and HF
`datasets` read them. The key is the request id with `.` written `%2E` (their loaders split a member name
at its first dot). Every sample of a shard has the same member set (HF `datasets` rejects a shard whose
samples differ), so shards are kept per kind: OUT/shards/<kind>/.

A shard is written under a hidden temporary name (`.<name>.<pid>.tar.tmp`) and becomes visible only when
finalized: the tar's end blocks written, fsynced, its index written atomically
(OUT/.cosmos3_batch/shards/<kind>/<name>.json), then renamed to `[TAG-]rankR-NNNNNN.tar` and the folder
fsynced. A killed run leaves only the temporary,
which the next run of the same tag deletes; its samples are generated again (unless the kill came after
the index was written: that index records the temporary, and the next run finishes the rename). Resume and
`status` read the indexes (one small file per shard), never the members. An index without its tar is
ignored.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from cosmos3_batch.io.metrics import STATE_DIR, iso_time
from cosmos3_batch.io.outputs import PREDICTS_ACTIONS, _fsync_dir, atomic_write

SHARDS = "shards"  # OUT/shards/<kind>/*.tar
INDEX_DIR = f"{STATE_DIR}/shards"  # OUT/.cosmos3_batch/shards/<kind>/<name>.json
STAGING_DIR = f"{STATE_DIR}/staging"  # members being encoded, per writer: [TAG-]rankR/
REASON_KIND = "reason"  # a reasoner request's shards: OUT/shards/reason/
# Its members: the generated text in `txt` (what a loader reads as the sample's text), the sidecar, and the
# prompt it was given under its own name, as the chained texts are (`prompt_upsampled.txt`, `caption.txt`).
REASON_MEMBERS = ("txt", "json", "prompt.txt")


def sample_key(request_id: str) -> str:
    """The WebDataset key of a request: loaders cut a member name at its first dot; ids may hold dots."""
    return request_id.replace(".", "%2E")


def shard_kind(request, save_latents: bool) -> str:
    """image | video | actions | transfer-image | transfer-video, then -sound, then -latents: one member set
    per kind (Transfer's latents are every chunk's, [chunks, C, T, H, W]: a training set reads them apart).
    A reasoner request's kind is `reason`: text out, no latents whatever --save-latents says."""
    if getattr(request, "reason", None) is not None:
        return REASON_KIND
    action = getattr(request, "action", None)
    if action is not None and action.mode in PREDICTS_ACTIONS:
        kind = "actions"
    else:
        kind = "image" if request.num_frames == 1 else "video"
        kind = f"transfer-{kind}" if getattr(request, "transfer", None) is not None else kind
    if getattr(request, "sound", False):
        kind += "-sound"
    return kind + ("-latents" if save_latents else "")


def member_suffixes(request, save_latents: bool) -> tuple[str, ...]:
    """The members a complete sample of `request` holds (what resume checks in the index)."""
    if getattr(request, "reason", None) is not None:
        return REASON_MEMBERS
    suffixes = ["png" if request.num_frames == 1 else "mp4", "json", "txt"]
    if getattr(request, "sound", False):
        suffixes.append("wav")
    action = getattr(request, "action", None)
    if action is not None and action.mode in PREDICTS_ACTIONS:
        suffixes.append("actions.safetensors")
    if save_latents:
        suffixes.append("latents.safetensors")
    return tuple(suffixes)


def writer_prefix(rank: int, tag: str) -> str:
    return f"{tag + '-' if tag else ''}rank{rank}"


@dataclass
class Pending:
    """A sample appended to an open shard: its index entry, and the metrics row written once it is final."""

    sample: dict
    row: dict


class ShardLost(OSError):
    """An open shard could not be finalized (its cause: a full disk): its samples are not written."""

    def __init__(self, pending: list[Pending], cause: BaseException):
        super().__init__(getattr(cause, "errno", None), str(cause), getattr(cause, "filename", None))
        self.pending = pending


@dataclass
class _Open:
    kind: str
    name: str  # relative to OUT: shards/<kind>/<stem>.tar
    tmp: Path
    file: object
    tar: tarfile.TarFile
    # The appended samples' index entries and rows, one JSON line each, kept on disk rather than in memory:
    # a 1 GB shard of small images holds 100,000s of them, and the writer's cost per sample must not grow.
    journal: object = None
    samples: int = 0

    def pending(self) -> list[Pending]:
        self.journal.seek(0)
        return [Pending(**json.loads(line)) for line in self.journal]


class ShardWriter:
    """One writer's open shards, one per kind (a rank's finisher thread is its only caller)."""

    def __init__(self, out: Path, rank: int, tag: str, max_bytes: int, max_samples: int):
        self.out = out
        self.rank = rank
        self.tag = tag
        self.prefix = writer_prefix(rank, tag)
        self.max_bytes, self.max_samples = max_bytes, max_samples
        self.staging = out / STAGING_DIR / self.prefix
        self._open: dict[str, _Open] = {}
        self._next: dict[str, int] = {}

    def stage(self, key: str, suffix: str) -> Path:
        """Where to encode one member before it is appended (removed by `add`)."""
        self.staging.mkdir(parents=True, exist_ok=True)
        return self.staging / f"{key}.{suffix}"

    def shard_of(self, kind: str) -> str:
        """The name (relative to OUT) of the shard the next sample of `kind` goes to, opening it."""
        return self._shard(kind).name

    def add(
        self, kind: str, key: str, members: list[tuple[str, Path]], sample: dict, row: dict
    ) -> list[Pending]:
        """Append one sample's staged members (each removed); returns the samples of a shard this closed
        (now final). On a failed append the shard is cut back to where it was (no torn member)."""
        shard = self._shard(kind)
        start, logged = shard.tar.offset, shard.journal.tell()
        offsets = {}
        try:
            for suffix, path in members:
                info = tarfile.TarInfo(f"{key}.{suffix}")
                info.size, info.mtime, info.mode = path.stat().st_size, int(time.time()), 0o644
                with open(path, "rb") as f:
                    shard.tar.addfile(info, f)
                shard.tar.members.clear()  # addfile keeps every header: a writer's memory must not grow
                offsets[suffix] = [shard.tar.offset - padded_size(info.size), info.size]
            entry = {"sample": {**sample, "key": key, "members": offsets}, "row": row}
            shard.journal.write(json.dumps(entry, separators=(",", ":")) + "\n")
            shard.journal.flush()
        except BaseException:
            shard.file.seek(start)
            shard.file.truncate(start)
            shard.tar.offset = start
            shard.journal.seek(logged)
            shard.journal.truncate(logged)
            raise
        finally:
            for _, path in members:
                path.unlink(missing_ok=True)
        shard.samples += 1
        full = self.max_bytes and shard.tar.offset >= self.max_bytes
        if full or (self.max_samples and shard.samples >= self.max_samples):
            return self._finalize(kind)
        return []

    def close(self) -> tuple[list[Pending], list[ShardLost]]:
        """Finalize every open shard (the end of the run): the samples now final, and the shards lost."""
        done, lost = [], []
        for kind in list(self._open):
            try:
                done += self._finalize(kind)
            except ShardLost as exc:
                lost.append(exc)
        with contextlib.suppress(OSError):
            self.staging.rmdir()
        return done, lost

    def _shard(self, kind: str) -> _Open:
        if kind in self._open:
            return self._open[kind]
        folder = self.out / SHARDS / kind
        folder.mkdir(parents=True, exist_ok=True)
        number = self._next.get(kind) or self._first_free(kind)
        self._next[kind] = number + 1
        stem = f"{self.prefix}-{number:06d}"
        # Hidden, and not ending in .tar: no loader's glob for shards ever picks up an open one.
        fd, name = tempfile.mkstemp(prefix=f".{stem}.{os.getpid()}.", suffix=".tar.tmp", dir=folder)
        # Unbuffered: a write the disk refuses fails at once, with nothing left in a buffer that a later
        # flush would add after the cut (add() cuts a failed sample back off).
        file = os.fdopen(fd, "wb+", buffering=0)
        # Both stay open while the shard fills: closed by _finalize.
        tar = tarfile.open(fileobj=file, mode="w", format=tarfile.PAX_FORMAT)  # noqa: SIM115
        self.staging.mkdir(parents=True, exist_ok=True)
        journal = open(self.staging / f"{kind}.samples.jsonl", "w+")  # noqa: SIM115 (closed by _finalize)
        shard = _Open(kind, f"{SHARDS}/{kind}/{stem}.tar", Path(name), file, tar, journal)
        self._open[kind] = shard
        return shard

    def _first_free(self, kind: str) -> int:
        """One past the highest number this writer's name has under its kind (tars and indexes alike)."""
        pattern = re.compile(rf"^{re.escape(self.prefix)}-(\d+)\.(tar|json)$")
        names = [p.name for d in (self.out / SHARDS / kind, self.out / INDEX_DIR / kind) if d.is_dir()
                 for p in d.iterdir()]  # fmt: skip
        numbers = [int(m[1]) for n in names if (m := pattern.match(n))]
        return max(numbers, default=0) + 1

    def _finalize(self, kind: str) -> list[Pending]:
        shard = self._open.pop(kind)
        final = self.out / shard.name
        pending = shard.pending()
        shard.journal.close()
        Path(shard.journal.name).unlink(missing_ok=True)
        if not pending:  # opened for a sample that then failed: no empty shard is left
            shard.file.close()
            shard.tmp.unlink(missing_ok=True)
            return []
        try:
            shard.tar.close()  # the end-of-archive blocks
            shard.file.flush()
            os.fsync(shard.file.fileno())
            shard.file.close()
            index = {
                "shard": shard.name,
                **tar_identity(shard.tmp),
                "finalized_at": iso_time(time.time()),
                "rank": self.rank,
                "tag": self.tag,
                "samples": [p.sample for p in pending],
            }
            write_index(index_path(self.out, shard.name), index)
            os.replace(shard.tmp, final)
            _fsync_dir(final.parent)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                shard.file.close()
            shard.tmp.unlink(missing_ok=True)  # nothing partial under a final name; its room freed
            if not final.exists():
                index_path(self.out, shard.name).unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise ShardLost(pending, exc) from exc
            raise
        return pending


def write_index(path: Path, index: dict) -> None:
    """A shard's index, compact (100,000 samples of small images: 75 MB, not 124 MB indented)."""
    text = json.dumps(index, separators=(",", ":"), sort_keys=True)
    atomic_write(path, lambda tmp: tmp.write_text(text))


def tar_identity(path: Path) -> dict:
    """What an index records of its tar: size and inode (a rewrite keeps the name, never the inode)."""
    st = path.stat()
    return {"bytes": st.st_size, "inode": st.st_ino}


def padded_size(size: int) -> int:
    return -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


def index_path(out: Path, shard_name: str) -> Path:
    """OUT/.cosmos3_batch/shards/<kind>/<stem>.json for shard `shards/<kind>/<stem>.tar`."""
    relative = Path(shard_name).relative_to(SHARDS)
    path = out / INDEX_DIR / relative.with_suffix(".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path
