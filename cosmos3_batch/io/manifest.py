"""OUT/manifest.parquet: one row per request OUT has a record of (DESIGN.md §12), for a training pipeline's
data loader and for bookkeeping: its status, where its output is (a file, or a shard and member), the
resolved request, the model and its digest, the rank, the timings, the error.

Written by rank 0 at the end of every run and by `cosmos3-batch manifest OUT`; both merge every rank and
every array task that shares OUT (complete outputs from sidecars or shard indexes, the others from the
metrics part files), under the lock the metrics merge holds. Columns: docs/outputs.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cosmos3_batch.io import dataset
from cosmos3_batch.io.catalog import Output, complete_outputs, require_run
from cosmos3_batch.io.metrics import iso_time, latest_rows, merge_lock
from cosmos3_batch.io.outputs import atomic_write
from cosmos3_batch.io.shard_index import drop_superseded, read_indexes

NAME = "manifest.parquet"
SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("status", pa.string()),  # ok | failed | interrupted | blocked | pending
        ("kind", pa.string()),
        ("format", pa.string()),  # files | webdataset
        ("path", pa.string()),  # relative to OUT: the media file, or the shard
        ("member", pa.string()),  # webdataset: the media member in the shard
        ("prompt", pa.string()),  # as in the request file (the one upsampled, if it was)
        ("prompt_original", pa.string()),  # upsample: the file's prompt (null when not asked)
        ("prompt_upsampled", pa.string()),  # ... the prompt generated from (null: not rewritten)
        ("caption", pa.string()),  # the reasoner's caption of the output (null when not asked)
        ("score", pa.float64()),  # the first number of the reasoner's score reply (null: none, or not asked)
        ("score_text", pa.string()),  # ... the reply itself
        ("negative_prompt", pa.string()),
        ("seed", pa.int64()),
        ("width", pa.int64()),
        ("height", pa.int64()),
        ("num_frames", pa.int64()),
        ("fps", pa.float64()),
        ("steps", pa.int64()),
        ("guidance", pa.float64()),
        ("model", pa.string()),
        ("model_digest", pa.string()),
        ("request_hash", pa.string()),
        ("output_key", pa.string()),  # SHA-256 of the request hash, the model identity, --vae-tiling
        ("inputs", pa.string()),  # JSON: each input file -> {bytes, mtime_ns, sha256}, as resume compares
        (
            "files",
            pa.string(),
        ),  # JSON: files: key -> {name, bytes}; webdataset: member suffix -> [offset, bytes]
        ("rank", pa.int64()),
        ("forwards", pa.string()),  # --cache sea, JSON: branch -> {computed, reused}; null without a cache
        ("prepare_s", pa.float64()),
        ("denoise_s", pa.float64()),
        ("decode_s", pa.float64()),
        ("write_s", pa.float64()),
        ("finished_at", pa.string()),
        ("error", pa.string()),
        ("sidecar_inode", pa.int64()),  # files: the sidecar's inode and size when the row was made (with
        ("sidecar_bytes", pa.int64()),  # finished_at, its mtime: a rerun trusts the row while all three hold)
    ]
)
TIMINGS = ("prepare_s", "denoise_s", "decode_s", "write_s")
STAMP = ("finished_at", "sidecar_inode", "sidecar_bytes")  # files: outputs.sidecar_stamp of the sidecar


def write_manifest(
    out: Path, requests=(), tag: str | None = None, rows: dict | None = None
) -> tuple[Path, int]:
    """Write OUT/manifest.parquet; `requests` (Request objects) fill in the prompt of requests with no output
    and add a `pending` row for those with no record at all. With `tag` (a run's end), this run's shards
    are first rewritten without samples that a newer shard holds again. `rows`: the latest metrics row per
    id, when the caller has just merged them. Returns (path, rows). ValueError if no run wrote to OUT."""
    require_run(out)
    with merge_lock(out):
        indexes = None  # the shard indexes, read once for both
        if tag is not None and dataset.of(out).format == "webdataset":
            indexes = drop_superseded(out, tag, read_indexes(out))
        table = build_manifest(out, requests, rows, indexes)
        atomic_write(out / NAME, lambda tmp: pq.write_table(table, tmp))
    return out / NAME, table.num_rows


def build_manifest(
    out: Path, requests=(), rows: dict | None = None, indexes: list[dict] | None = None
) -> pa.Table:
    """The rows. A complete output's row of the previous manifest.parquet is kept when its sidecar has not
    changed since (same mtime, inode and size): a rerun over 100,000 complete requests stats their
    sidecars, reads none. `indexes`: the shard indexes as the caller just read them (webdataset)."""
    fmt = dataset.of(out).format
    previous, recorded = _previous(out, fmt)
    reused: set[str] = set()

    def unchanged(rid: str, stamp: tuple) -> bool:
        if recorded.get(rid) == stamp:
            reused.add(rid)
            return True
        return False

    done = complete_outputs(out, unchanged, indexes)
    rows = latest_rows(out, warn=False) if rows is None else rows
    known = {r.id: r for r in requests}
    records = []
    for rid in sorted((set(done) | set(rows) | set(known)) - reused):
        if rid in done:
            records.append(_complete(done[rid], rows.get(rid), fmt))
        else:
            records.append(_not_complete(rid, rows.get(rid), known.get(rid), fmt))
    table = pa.Table.from_pylist(records, schema=SCHEMA)
    if reused:  # their rows as they were, taken over column by column
        kept = previous.filter(pc.is_in(previous["id"], value_set=pa.array(sorted(reused), pa.string())))
        table = pa.concat_tables([kept, table]).sort_by("id")
    return table


def recorded_sidecars(out: Path) -> dict[str, tuple[tuple, dict]]:
    """id -> (its sidecar's stamp as recorded: mtime, inode, size; what resume checks of it), from the last
    manifest.parquet (files format): `outputs.is_complete` uses it while the sidecar's stamp is unchanged."""
    if dataset.of(out).format != "files":
        return {}
    try:
        columns = ["id", "status", "request_hash", "output_key", "inputs", "files", *STAMP]
        table = pq.read_table(out / NAME, columns=columns).to_pydict()
    except (OSError, pa.ArrowException, KeyError):
        return {}
    found = {}
    for rid, status, content, key, inputs, files, *stamp in zip(*(table[c] for c in columns), strict=True):
        if status == "ok" and files and None not in stamp:
            sidecar = {"status": "complete", "request_hash": content, "output_key": key}
            sidecar["inputs"] = None if inputs is None else json.loads(inputs)
            found[rid] = (tuple(stamp), {**sidecar, "files": json.loads(files)})
    return found


def _previous(out: Path, fmt: str) -> tuple[pa.Table | None, dict[str, str]]:
    """The manifest written before, and id -> its sidecar's stamp (`finished_at`, inode, size) of each
    complete output in it (files format: those rows are reused while their sidecars are unchanged)."""
    if fmt != "files":
        return None, {}
    try:
        table = pq.read_table(out / NAME)
    except (OSError, pa.ArrowException):
        return None, {}
    if table.schema != SCHEMA:
        return None, {}
    columns = table.select(["id", "status", "path", *STAMP]).to_pydict()
    recorded = {
        rid: tuple(stamp)
        for rid, status, path, *stamp in zip(*columns.values(), strict=True)
        if status == "ok" and path and None not in stamp
    }
    return table, recorded


def _complete(output: Output, row: dict | None, fmt: str) -> dict:
    record = output.record
    request = record.get("request") or {}
    timings = record.get("timings") or {}
    rank = record.get("rank")
    if rank is None and row is not None and row.get("status") == "ok":
        rank = _number(row.get("rank"), int)
    return {
        **_request_columns(request),
        **_chain_columns(record),
        "id": output.id,
        "status": "ok",
        "kind": record.get("kind"),
        "format": fmt,
        "path": output.path,
        "member": output.member,
        "seed": record.get("seed", request.get("seed")),
        "model": record.get("model"),
        "model_digest": record.get("model_digest"),
        "request_hash": record.get("request_hash"),
        "output_key": record.get("output_key"),
        "inputs": None if record.get("inputs") is None else json.dumps(record["inputs"], sort_keys=True),
        "files": json.dumps(record.get("files") or record.get("members") or {}, sort_keys=True),
        "rank": rank,
        "forwards": _forwards(record.get("cache")),
        **{k: _number(timings.get(k), float) for k in TIMINGS},
        "finished_at": iso_time(output.finished),
        "error": None,
        **dict(zip(STAMP[1:], output.stamp[1:] if output.stamp else (None, None), strict=True)),
    }


def _not_complete(rid: str, row: dict | None, request, fmt: str) -> dict:
    resolved = request.resolved() if request is not None else {}
    record = {**_request_columns(resolved), "id": rid, "format": fmt, "status": "pending"}
    if request is not None:
        record.update(kind=request.kind, seed=request.seed, request_hash=request.content_hash())
    if row is not None:
        record.update(
            status=row["status"],
            kind=row.get("kind") or record.get("kind"),
            seed=_number(row.get("seed"), int),
            width=_number(row.get("width"), int),
            height=_number(row.get("height"), int),
            num_frames=_number(row.get("num_frames"), int),
            steps=_number(row.get("steps"), int),
            guidance=_number(row.get("guidance"), float),
            rank=_number(row.get("rank"), int),
            finished_at=row.get("finished_at") or None,
            error=row.get("error") or None,
            **{k: _number(row.get(k), float) for k in TIMINGS},
        )
    return record


def _forwards(cache: dict | None) -> str | None:
    """The sidecar's per-branch forwards under --cache sea, as JSON text."""
    forwards = (cache or {}).get("forwards")
    return None if forwards is None else json.dumps(forwards, sort_keys=True)


def _chain_columns(record: dict) -> dict:
    """The upsampled prompt, caption and score of a sidecar (io/text_outputs.py chain_facts)."""
    upsample, texts = record.get("upsample") or {}, record.get("captions") or {}
    caption, score = texts.get("caption") or {}, texts.get("score") or {}
    return {
        "prompt_original": upsample.get("prompt_original"),
        "prompt_upsampled": upsample.get("prompt_upsampled"),
        "caption": caption.get("text"),
        "score": _number(score.get("score"), float),
        "score_text": score.get("text"),
    }


def _request_columns(request: dict) -> dict:
    return {
        "prompt": request.get("prompt"),
        "negative_prompt": request.get("negative_prompt"),
        "width": request.get("width"),
        "height": request.get("height"),
        "num_frames": request.get("num_frames"),
        "fps": request.get("fps"),
        "steps": request.get("num_inference_steps"),
        "guidance": request.get("guidance_scale"),
    }


def _number(value, kind):
    if value in (None, ""):
        return None
    try:
        return kind(float(value)) if kind is int else kind(value)
    except (TypeError, ValueError):
        return None
