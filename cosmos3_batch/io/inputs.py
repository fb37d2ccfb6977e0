"""The files a request reads (its image, video, Transfer controls, action file), as its sidecar records them
and as resume compares them: a file replaced in place under the same name makes the request mean something
else, so its old output is not complete any more.

Recorded per file: size, mtime (ns) and sha256. Resume compares size and mtime first (a stat); only a file
whose stat differs is hashed again, and it is changed only if its sha256 differs too (a copy that kept its
bytes, or a `touch`, is not a change). A sidecar without the record (written before it existed) is trusted
as it was."""

from __future__ import annotations

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


def input_record(request) -> dict[str, dict]:
    """The sidecar's `inputs`: path -> {bytes, mtime_ns, sha256}."""
    record = {}
    for path in input_paths(request):
        st = os.stat(path)
        record[path] = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": file_sha256(path)}
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
        if st.st_size != was.get("bytes") or file_sha256(path) != was.get("sha256"):
            return f"input {path} changed since it was generated"
    return None
