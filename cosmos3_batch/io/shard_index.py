"""Reading finalized WebDataset shards through their indexes (resume, `status`, `manifest`, `export`,
`report`), cleaning up what a killed writer left, and dropping samples a later run regenerated.

Only finalized shards count: an index is read only when its tar is there with the size the index records,
so a reader running beside a job (`status` during a run) never sees a shard being written.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from cosmos3_batch.io.metrics import iso_time
from cosmos3_batch.io.outputs import _fsync_dir
from cosmos3_batch.io.shards import (
    INDEX_DIR,
    SHARDS,
    STAGING_DIR,
    index_path,
    padded_size,
    tar_identity,
    write_index,
    writer_prefix,
)

log = logging.getLogger("cosmos3_batch")


@dataclass(frozen=True)
class Located:
    """A sample in a finalized shard."""

    shard: str  # relative to OUT: shards/<kind>/<name>.tar
    sample: dict  # its index entry: id, key, members {suffix: [data offset, bytes]}, request, hashes, ...
    finalized_at: str

    def member(self, suffix: str) -> str:
        return f"{self.sample['key']}.{suffix}"

    def read(self, out: Path, suffix: str) -> bytes:
        """One member's bytes, read at its offset (no scan of the tar)."""
        offset, size = self.sample["members"][suffix]
        with open(out / self.shard, "rb") as f:
            f.seek(offset)
            return f.read(size)


def read_indexes(out: Path) -> list[dict]:
    """Every finalized shard's index, oldest first; an index whose tar is missing or of another size (a crash
    between the index and the rename) is skipped, and so is one whose tar is another file (inode) while a
    temporary of that shard exists (the rename of a finalize or rewrite is pending). Another inode and no
    temporary: the folder was copied or moved (cp -r, rsync, another filesystem), and the tar is the one."""
    found = []
    for path in sorted((out / INDEX_DIR).glob("*/*.json")):
        if path.name.startswith("."):  # an index's temporary (a write a kill cut short): never an index
            continue
        try:
            index = json.loads(path.read_text())
            tar = out / index["shard"]
            st = tar.stat()
            if st.st_size != index["bytes"]:
                continue
            if st.st_ino != index.get("inode", st.st_ino) and _rename_pending(tar):
                continue
        except (OSError, ValueError, KeyError, TypeError):
            continue
        found.append(index)
    return sorted(found, key=lambda i: (i["finalized_at"], i["shard"]))


def _rename_pending(tar: Path) -> bool:
    return any(tar.parent.glob(f".{tar.stem}.*.tar.tmp"))


def latest_samples(indexes: list[dict]) -> dict[str, Located]:
    """Request id -> its newest finalized sample."""
    latest: dict[str, Located] = {}
    for index in indexes:
        for sample in index["samples"]:
            latest[sample["id"]] = Located(index["shard"], sample, index["finalized_at"])
    return latest


def finish_renames(out: Path, tag: str) -> int:
    """Finish the renames a kill interrupted, in a finalize or a rewrite of this tag's shards: a temporary
    that its shard's index already records (size and inode) is complete and fsynced, so it is renamed into
    place instead of being lost (or, after a rewrite, instead of the old tar staying with samples the index
    no longer lists). Returns the shards renamed."""
    renamed = 0
    for path in _temporaries(out, tag):
        if _recorded_by_index(out, path):
            os.replace(path, path.with_name(_stem(path) + ".tar"))
            _fsync_dir(path.parent)
            renamed += 1
    return renamed


def remove_stale(out: Path, tag: str) -> int:
    """What killed writers of this tag left: open shards' temporaries (after `finish_renames`), staging
    folders, indexes whose tar never appeared, and indexes' temporaries (a finalize killed as it wrote the
    index: its tar's temporary is unrecorded, deleted above). Other array tasks' files (other tags) are theirs
    and may be in use: never touched. Returns the shard temporaries deleted."""
    finish_renames(out, tag)
    removed = 0
    for path in _temporaries(out, tag):
        path.unlink(missing_ok=True)
        removed += 1
    prefix = f"{tag}-rank" if tag else "rank"
    for path in (out / INDEX_DIR).glob(f"*/.{prefix}*.tmp.json"):  # outputs.atomic_write's temporaries
        path.unlink(missing_ok=True)
    for folder in (out / STAGING_DIR).glob(f"{prefix}*"):
        shutil.rmtree(folder, ignore_errors=True)
    for path in (out / INDEX_DIR).glob(f"*/{prefix}*.json"):
        if not (out / SHARDS / path.parent.name / path.with_suffix(".tar").name).exists():
            path.unlink(missing_ok=True)
    return removed


def _temporaries(out: Path, tag: str) -> list[Path]:
    prefix = f"{tag}-rank" if tag else "rank"
    return sorted((out / SHARDS).glob(f"*/.{prefix}*.tar.tmp"))


def _stem(tmp: Path) -> str:
    """`[TAG-]rankR-NNNNNN` of a temporary `.<stem>.<pid>[.<random>].tar.tmp` (a stem holds no dot)."""
    return tmp.name[1:].split(".", 1)[0]


def _recorded_by_index(out: Path, tmp: Path) -> bool:
    """Whether the index of `tmp`'s shard records `tmp` itself (its size and inode)."""
    try:
        index = json.loads((out / INDEX_DIR / tmp.parent.name / f"{_stem(tmp)}.json").read_text())
        st = tmp.stat()
        return (index["bytes"], index["inode"]) == (st.st_size, st.st_ino)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def drop_superseded(out: Path, tag: str, indexes: list[dict] | None = None) -> list[dict]:
    """Rewrite this tag's shards without samples that a newer shard holds again (a request regenerated by
    --overwrite, or after its request or the model changed), so a loader never reads one id twice. Each
    rewrite is atomic like a first write. `indexes`: `read_indexes(out)` when the caller has them. Returns
    the indexes as they are now (the rewritten ones replaced, the emptied ones gone), for the manifest."""
    indexes = read_indexes(out) if indexes is None else indexes
    newest = {sid: loc.shard for sid, loc in latest_samples(indexes).items()}
    mine = writer_prefix(0, tag).removesuffix("0")  # "[TAG-]rank"
    now = []
    for index in indexes:
        stale = {s["id"] for s in index["samples"] if newest.get(s["id"]) != index["shard"]}
        if stale and Path(index["shard"]).name.startswith(mine):
            index = _rewrite(out, index, stale)
        if index is not None:
            now.append(index)
    return now


def _rewrite(out: Path, index: dict, stale: set[str]) -> dict | None:
    """The shard without the `stale` samples; its new index (None: nothing was left, the shard is gone)."""
    keep = [s for s in index["samples"] if s["id"] not in stale]
    final = out / index["shard"]
    if not keep:
        final.unlink(missing_ok=True)  # the tar first: an index without its tar is ignored
        index_path(out, index["shard"]).unlink(missing_ok=True)
        return None
    tmp = final.with_name(f".{final.stem}.{os.getpid()}.tar.tmp")
    try:
        with open(final, "rb") as src, open(tmp, "wb") as dst:
            tar = tarfile.open(fileobj=dst, mode="w", format=tarfile.PAX_FORMAT)  # noqa: SIM115 (closed below)
            for sample in keep:
                moved = {}
                for suffix, (offset, size) in sample["members"].items():
                    info = tarfile.TarInfo(f"{sample['key']}.{suffix}")
                    info.size, info.mtime, info.mode = size, int(time.time()), 0o644
                    src.seek(offset)
                    tar.addfile(info, _Slice(src, size))
                    tar.members.clear()  # as the writer: no header list growing with the shard
                    moved[suffix] = [tar.offset - padded_size(size), size]
                sample["members"] = moved
            tar.close()
            dst.flush()
            os.fsync(dst.fileno())
        # Its samples keep their age (finalized_at); the inode tells the new tar from the old.
        rewritten = {**index, "samples": keep, **tar_identity(tmp), "rewritten_at": iso_time(time.time())}
        # The index is replaced before the tar: in between, the old tar's inode no longer matches, so readers
        # skip the shard for that instant instead of reading members at the wrong offsets.
        write_index(index_path(out, index["shard"]), rewritten)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    finally:
        tmp.unlink(missing_ok=True)
    return rewritten


class _Slice:
    """A file object reading `size` bytes from `f`'s position (tarfile copies members through read())."""

    def __init__(self, f, size: int):
        self.f, self.left = f, size

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        data = self.f.read(n)
        self.left -= len(data)
        return data


def shard_files(out: Path) -> list[Path]:
    """The finalized tars under OUT/shards/, by kind then name."""
    with contextlib.suppress(OSError):
        return sorted((out / SHARDS).glob("*/*.tar"))
    return []


def sample_complete(
    found: Located | None, request, content: str, key: str, save_latents: bool
) -> tuple[bool, str]:
    """Resume's check of a request against its newest finalized sample: same request, model and decode
    settings, and every member it must have (as `outputs.is_complete` checks a sidecar)."""
    from cosmos3_batch.io.inputs import inputs_changed
    from cosmos3_batch.io.shards import member_suffixes

    if found is None:
        return False, "no finalized sample"
    if found.sample.get("request_hash") != content:
        return False, "request changed since it was generated"
    if found.sample.get("output_key") != key:
        return False, "model or decode settings changed since it was generated"
    if (changed := inputs_changed(found.sample.get("inputs"))) is not None:
        return False, changed
    missing = [s for s in member_suffixes(request, save_latents) if s not in found.sample.get("members", {})]
    if missing:
        return False, f"its sample has no {', '.join(missing)} member"
    return True, ""
