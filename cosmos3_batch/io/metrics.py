"""metrics.csv: one row per request, appended and fsynced by each rank to its own part file as soon as
the request ends, merged into metrics.csv at the end of the run. A crash loses no finished row.

The part files (the crash-safe journal, one per rank and run tag) and the merge lock live in a hidden
folder of their own, `OUT/.cosmos3_batch/`, so the dataset folder holds only outputs and reports.
Every column is documented in docs/outputs.md.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import fcntl
import io
import logging
import os
import re
from pathlib import Path
from typing import NamedTuple

from cosmos3_batch.io.outputs import atomic_write, iso_time

__all__ = ["iso_time"]  # defined beside the sidecars it dates (outputs.py); imported from here too

log = logging.getLogger("cosmos3_batch")

COLUMNS = (
    "id",
    "status",
    "kind",
    "width",
    "height",
    "num_frames",
    "steps",
    "guidance",
    "seed",
    "tokens",
    "queue_s",
    "latency_s",
    "prepare_s",
    "denoise_s",
    "decode_s",
    "write_s",
    "weight_bytes",
    "stall_s",
    "rank",
    "admitted_at",
    "finished_at",
    "output",
    "error",
    "forwards_computed",  # --cache sea: the request's forwards (all branches) that ran the layers ...
    "forwards_reused",  # ... and that reused a residual instead; empty without a cache
)
STATE_DIR = ".cosmos3_batch"
PART_GLOB = "metrics.*rank*.csv"


def state_dir(out_dir: Path) -> Path:
    """OUT/.cosmos3_batch, created on first use (by rank 0 before the ranks meet: job.py). Anything else
    planted at that name (a symlink, a file) is replaced, never followed. Part files that versions before
    the folder existed left in OUT itself move in, so their rows stay in metrics.csv."""
    path = out_dir / STATE_DIR
    # Array tasks sharing OUT may do this at the same moment: each step tolerates the other's.
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink(missing_ok=True)
    path.mkdir(exist_ok=True)
    for old in out_dir.glob(".metrics.*rank*.csv"):
        if old.is_file() and not old.is_symlink():
            with contextlib.suppress(FileNotFoundError):
                old.replace(path / old.name.removeprefix("."))
    (out_dir / ".metrics.lock").unlink(missing_ok=True)
    return path


class MetricsWriter:
    """Appends rows to this writer's part file, each row whole or not at all.

    A row is one `os.write` of its CSV text, then fsync; a write the disk refuses part-way is cut back off
    (`ftruncate`), so a full disk never leaves a torn row that the next row would be glued onto. A torn
    tail left by a crash mid-write is cut off when the file is opened again."""

    def __init__(self, out_dir: Path, rank: int, tag: str = ""):
        # One part file per writer: ranks, and array tasks sharing --out, never append to the same file.
        self.path = out_dir / STATE_DIR / f"metrics.{tag + '-' if tag else ''}rank{rank}.csv"
        # Our own hidden file: a symlink planted at its name is replaced, never appended through.
        if self.path.is_symlink():
            self.path.unlink()
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        _cut_torn_tail(self._fd)
        if os.fstat(self._fd).st_size == 0:
            self._append(",".join(COLUMNS) + "\r\n")

    def row(self, **fields) -> None:
        buffer = io.StringIO()
        csv.DictWriter(buffer, fieldnames=COLUMNS, extrasaction="raise").writerow(
            {key: _cell(fields.get(key)) for key in COLUMNS}
        )
        self._append(buffer.getvalue())

    def _append(self, text: str) -> None:
        data = text.encode()
        size = os.fstat(self._fd).st_size
        try:
            if os.write(self._fd, data) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
            os.fsync(self._fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, size)  # no torn row: the file ends where it ended before
            raise

    def close(self) -> None:
        os.close(self._fd)


def _cut_torn_tail(fd: int) -> None:
    """Cut a last line that lacks its newline (a crash mid-append): the file then ends after a whole row."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return
    chunk = min(size, 1 << 16)
    tail = os.pread(fd, chunk, size - chunk)
    os.ftruncate(fd, size - chunk + tail.rfind(b"\n") + 1 if b"\n" in tail else 0)


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6f}"
    return str(value)


def merge_metrics(out_dir: Path) -> tuple[Path, list[dict]]:
    """Union of every part file in --out (all runs, all ranks); a request's latest row wins.

    Array tasks sharing --out may finish together: the lock makes each read-merge-rename see the
    others' finished merges, so the last one writes the full union."""
    with merge_lock(out_dir):
        return _merge_locked(out_dir)


@contextlib.contextmanager
def merge_lock(out_dir: Path):
    """Held while a run's end rewrites what every array task sharing OUT contributes to (metrics.csv,
    manifest.parquet, shards rewritten without superseded samples)."""
    with open(out_dir / STATE_DIR / "metrics.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def latest_rows(out_dir: Path, warn: bool = True) -> dict[str, dict]:
    """Request id -> its latest row over every part file in OUT (all runs, ranks and array tasks)."""
    rows: dict[str, dict] = {}
    all_rows = []
    for part in sorted((out_dir / STATE_DIR).glob(PART_GLOB)):
        good, bad = read_part(part)
        all_rows += good
        if bad and warn:
            log.warning("%s: skipped %d unreadable line(s) (a crash mid-append?)", part, bad)
    # Part files of older versions may lack columns (None here) or hold Unix times: ISO text sorts alike.
    for row in sorted(all_rows, key=lambda r: _sort_time(r.get("finished_at"))):
        rows[row["id"]] = {key: row.get(key) or "" for key in COLUMNS}
    return rows


def merge_pending(out_dir: Path) -> bool:
    """Some part file holds rows metrics.csv lacks (it is missing, or older than a part): the rerun of a
    finished job merges nothing (at 100,000 requests the merge was seconds of its start-up and end)."""
    try:
        merged = (out_dir / "metrics.csv").stat().st_mtime_ns
    except OSError:
        merged = -1
    return any(part.stat().st_mtime_ns >= merged for part in (out_dir / STATE_DIR).glob(PART_GLOB))


def merged_rows(out_dir: Path) -> dict[str, dict] | None:
    """metrics.csv's rows by id (the latest row of each request), or None if it cannot be read."""
    try:
        with open(out_dir / "metrics.csv", newline="") as f:
            return {row["id"]: row for row in csv.DictReader(f)}
    except (OSError, csv.Error, KeyError):
        return None


def _merge_locked(out_dir: Path) -> tuple[Path, list[dict]]:
    merged = sorted(latest_rows(out_dir).values(), key=lambda r: r["id"])
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS)
    writer.writeheader()
    writer.writerows(merged)
    path = out_dir / "metrics.csv"
    atomic_write(path, lambda tmp: tmp.write_text(buffer.getvalue()))
    return path, merged


STATUSES = {"ok", "failed", "interrupted", "blocked"}
_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")


def read_part(path: Path) -> tuple[list[dict], int]:
    """A part file's rows, and how many of its lines were not rows: a torn last line (a crash or a full
    disk mid-append) or bytes that are not CSV at all are skipped, never a reason to fail the merge."""
    text = path.read_text(encoding="utf-8", errors="replace").replace("\0", "")
    reader = csv.reader(io.StringIO(text, newline=""))
    header, rows, bad = None, [], 0
    while True:
        try:
            fields = next(reader)
        except StopIteration:
            return rows, bad
        except csv.Error:
            bad += 1
            continue
        if header is None:
            header = fields
            continue
        # A part file begun by an older version has its header; this version appends rows of all COLUMNS.
        names = COLUMNS if len(fields) == len(COLUMNS) else header if len(fields) == len(header) else None
        row = dict(zip(names, fields, strict=True)) if names else {}
        if names is None or row.get("status") not in STATUSES or not _ID.fullmatch(row.get("id", "")):
            bad += 1
            continue
        rows.append(row)


def ids_with_ok_rows(out_dir: Path) -> set[str]:
    """Requests that some part file records as ok."""
    return {
        row["id"]
        for part in (out_dir / STATE_DIR).glob(PART_GLOB)
        for row in read_part(part)[0]
        if row["status"] == "ok"
    }


def _sort_time(value: str | None) -> str:
    if not value:
        return ""
    try:
        return iso_time(float(value))
    except ValueError:
        return value


def passes_path(out_dir: Path, rank: int, tag: str = "") -> Path:
    return out_dir / STATE_DIR / f"passes.{tag + '-' if tag else ''}rank{rank}.csv"


class PassRecord(NamedTuple):
    """One pass on this rank, as the run report draws it (columns of passes.*.csv)."""

    index: int
    start_s: float  # since the pass loop began on this rank
    duration_s: float  # walking the layers: fetch waits + compute
    und: bool  # the UND parts were fetched
    active: int  # requests that rode on this pass
    stall_s: float  # compute waited for a part
    weight_bytes: int  # host->device + gathered on this rank
    fetch_skipped: bool = False  # --cache sea: no branch of any rank computed: no layer walked or fetched
    computed: int = 0  # this rank's branches that ran the layers (fewer than its active ones' under --cache)
    gen: bool = True  # the GEN parts were fetched (some rank had GEN work)


def write_passes(out_dir: Path, rank: int, tag: str, columns: tuple[str, ...], rows: list[tuple]) -> Path:
    """This rank's pass timeline of the latest run (what `report` draws), written once at its end."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(columns)
    writer.writerows([_cell(v) for v in row] for row in rows)
    path = passes_path(out_dir, rank, tag)
    atomic_write(path, lambda tmp: tmp.write_text(buffer.getvalue()))
    return path
