"""The files a request reads (its image, video, Transfer controls, action file), as its sidecar records them
and as resume compares them: a file replaced in place under the same name makes the request mean something
else, so its old output is not complete any more.

Recorded per file: size, mtime (ns) and sha256. Resume compares size and mtime first (a stat); only a file
whose stat differs is hashed again, and it is changed only if its sha256 differs too (a copy that kept its
bytes, or a `touch`, is not a change). A sidecar without the record (written before it existed) is trusted
as it was."""

from __future__ import annotations

import functools
import hashlib
import os

from cosmos3_batch.requests.transfer import AUTO  # a control derived from the request's video


def input_paths(request) -> list[str]:
    """Every file the request reads, each once, in a fixed order."""
    paths = [request.image, request.video]
    if request.transfer is not None:
        paths += [request.transfer.video, *(path for _, path in request.transfer.controls if path != AUTO)]
    if request.action is not None and isinstance(request.action.actions, str):
        paths.append(request.action.actions)
    return list(dict.fromkeys(p for p in paths if p))


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@functools.lru_cache(maxsize=4096)
def _sha256_at(path: str, size: int, mtime_ns: int) -> str:
    return file_sha256(path)


def sha256_of(path: str) -> str:
    """The file's sha256, hashed once per process for each (size, mtime) it is seen with: a control or an
    input shared by many requests is read once, not once per request."""
    st = os.stat(path)
    return _sha256_at(path, st.st_size, st.st_mtime_ns)


def input_stats(request) -> dict[str, tuple[int, int]]:
    """Each input's (size, mtime_ns) now: taken when the request reads its inputs (`input_record` then
    records the bytes that were read, not those of a file replaced before the output was written)."""
    stats = {}
    for path in input_paths(request):
        st = os.stat(path)
        stats[path] = (st.st_size, st.st_mtime_ns)
    return stats


def input_record(request, read: dict[str, tuple[int, int]] | None = None) -> dict[str, dict]:
    """The sidecar's `inputs`: path -> {bytes, mtime_ns, sha256} as the request read them (`read`: their
    stats then). A file whose stat changed since it was read is recorded with the stat it had and no sha256:
    the next run finds it changed and generates the request again."""
    record = {}
    for path in input_paths(request):
        st = os.stat(path)
        now = (st.st_size, st.st_mtime_ns)
        size, mtime_ns = was = now if read is None else read.get(path, now)
        sha = _sha256_at(path, *now) if was == now else None
        record[path] = {"bytes": size, "mtime_ns": mtime_ns, "sha256": sha}
    return record


def inputs_changed(record) -> str | None:
    """Why the recorded inputs are not the files there now (None: they are, or nothing was recorded)."""
    if not isinstance(record, dict):
        return None
    for path, was in record.items():
        try:
            st = os.stat(path)
        except OSError:
            return f"input {path} is gone"
        if not isinstance(was, dict):
            return f"input {path} recorded without its size and hash"
        if st.st_size == was.get("bytes") and st.st_mtime_ns == was.get("mtime_ns"):
            continue
        try:
            same = st.st_size == was.get("bytes") and _sha256_at(path, st.st_size, st.st_mtime_ns) == was.get(
                "sha256"
            )
        except OSError:
            return f"input {path} cannot be read"
        if not same:
            return f"input {path} changed since it was generated"
    return None
