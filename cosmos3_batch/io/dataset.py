"""How a run's --out is laid out (DESIGN.md §12): the format (`files` or `webdataset`), and for files the
layout (`flat`, or `nested`: each request's files under OUT/<2 hex digits of a hash of its id>/).

A folder of a million files is slow to list and to resume from on Lustre or NFS, so above NESTED_ABOVE
requests `nested` is the default. The choice is recorded in OUT/.cosmos3_batch/dataset.json by the first
run, and every later run, `report`, `status`, `manifest` and `export` read it from there: a rerun with a
longer request file keeps the layout its outputs were written in.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from cosmos3_batch.io.metrics import STATE_DIR
from cosmos3_batch.io.outputs import bucket, request_dir, write_json

__all__ = ["bucket", "request_dir"]
log = logging.getLogger("cosmos3_batch")

FORMATS = ("files", "webdataset")
LAYOUTS = ("flat", "nested")
NESTED_ABOVE = 10_000  # requests in the input (all --shard slices together) above which nested is the default
RECORD = "dataset.json"  # under OUT/.cosmos3_batch/


@dataclass(frozen=True)
class Dataset:
    format: str = "files"
    layout: str = "flat"  # files only; a webdataset's samples live in shards/<kind>/

    def to_dict(self) -> dict:
        return {"format": self.format, "layout": self.layout}


def read_record(out: Path) -> Dataset | None:
    """The format and layout OUT was written in, or None for a folder no run of this version wrote to (a
    folder of an earlier version holds flat files: callers treat None as that)."""
    try:
        data = json.loads((out / STATE_DIR / RECORD).read_text())
        return Dataset(str(data["format"]), str(data["layout"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def of(out: Path) -> Dataset:
    """What OUT holds, for the readers (`report`, `status`, `manifest`, `export`)."""
    return read_record(out) or Dataset()


def choose(out: Path, fmt: str, layout: str | None, requests: int) -> Dataset:
    """The dataset a run writes: the one OUT already holds, else the flags', else the default for `requests`
    (the whole input, so every array task of one job decides alike). ValueError when the flags contradict
    what OUT holds (the outputs there would not be found, and a second copy of every request written)."""
    recorded = read_record(out)
    if recorded is not None:
        if fmt != recorded.format or (layout is not None and fmt == "files" and layout != recorded.layout):
            given = fmt if fmt != recorded.format else f"--layout {layout}"
            held = recorded.format if fmt != recorded.format else f"a {recorded.layout} layout"
            raise ValueError(
                f"--out {out} holds {held} ({STATE_DIR}/{RECORD}), not {given}: rerun with its settings, "
                "or choose another --out"
            )
        return recorded
    if fmt == "webdataset":
        return Dataset("webdataset", "flat")
    if layout is None and requests > NESTED_ABOVE:
        log.info("%d requests (> %d): files go to 256 subfolders of --out by id hash (--layout nested)",
                 requests, NESTED_ABOVE)  # fmt: skip
        return Dataset("files", "nested")
    return Dataset("files", layout or "flat")


def write_record(out: Path, dataset: Dataset) -> None:
    """Record the choice (rank 0, before any output is written); array tasks may race to the same bytes."""
    if read_record(out) != dataset:
        write_json(out / STATE_DIR / RECORD, dataset.to_dict())


def parse_shard_size(text: str) -> tuple[int, int]:
    """--shard-size: '1GB', '512MiB', '200000000B' (bytes) or '1000' (samples) -> (max bytes, max samples);
    0 means no limit of that kind."""
    units = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    units |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    value = text.strip().upper().replace(" ", "")
    number, unit = value.rstrip("KMGTIB"), value[len(value.rstrip("KMGTIB")) :]
    try:
        amount = float(number)
    except ValueError:
        amount = -1.0
    if (unit and unit not in units) or amount <= 0 or (not unit and not number.isdigit()):
        raise ValueError(
            f"--shard-size must be a byte size (e.g. 1GB, 512MiB) or a number of samples (e.g. 1000), "
            f"got {text!r}"
        )
    if not unit:
        return 0, int(number)
    return max(1, int(amount * units[unit])), 0
