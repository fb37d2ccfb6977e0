"""`cosmos3-batch status OUT [--input FILE]`: how far a job (or a Slurm array of jobs sharing OUT) is.

Reads finalized files only (sidecars, shard indexes, the metrics part files whose torn last line is
skipped), so it is safe while the job runs. Per request: done (a complete output), failed, interrupted
(the latest record says so), or pending (in the input, no record: needs --input; null in --json without
it). The rate is the outputs that became final in the last hour over the time they were being generated
(each output's own timings, overlaps counted once): a stop between two runs is not generation time; the
ETA is what is left at that rate. With `--json`, also the figures
the last run of each summary file ended with (`runs`): what `--metrics-textfile`'s counters end at.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from cosmos3_batch.io import dataset
from cosmos3_batch.io.catalog import complete_outputs, require_run
from cosmos3_batch.io.metrics import STATE_DIR, latest_rows
from cosmos3_batch.requests.parse import shard_index

STATES = ("done", "failed", "interrupted", "pending")
WINDOW_S = 3600.0
# summary.json, or summary.shardIofN.json per array task (pipeline/job/summary.py); not a sidecar:
# a request may be called "summary2", never "summary" (requests/fields.py RESERVED_IDS).
SUMMARY = re.compile(r"summary(\.shard\d+of\d+)?\.json")


def dataset_status(out: Path, ids: Iterable[str] | None = None, now: float | None = None) -> dict:
    """The counts, the rate and the ETA; `ids`: the input's request ids (pending needs them). With array
    tasks (`--shard I/N` runs wrote to OUT), also the counts per task of the latest N. ValueError if OUT
    holds no run."""
    require_run(out)
    now = time.time() if now is None else now
    done = complete_outputs(out)
    rows = latest_rows(out, warn=False)
    wanted = set(ids) if ids is not None else None
    known = (set(done) | set(rows)) if wanted is None else wanted
    state = {rid: _state(rid, done, rows) for rid in known}
    counts = Counter(state.values())
    latest = [output for rid, output in done.items() if output.finished >= now - WINDOW_S and rid in known]
    recent, busy = len(latest), generation_seconds(latest, now - WINDOW_S)
    left = len(known) - counts["done"] - counts["blocked"]  # a rerun generates the failed ones again too
    per_hour = recent * 3600.0 / (busy if busy > 0 else WINDOW_S)  # no timings recorded: over the hour
    report = {
        "out": str(out),
        "format": dataset.of(out).format,
        "requests": len(known),
        **{name: counts[name] for name in STATES},
        "blocked": counts["blocked"],  # by the guardrails (docs/guardrails.md): final, as done is
        "pending": counts["pending"] if wanted is not None else None,  # unknown without --input
        "pending_known": wanted is not None,
        "outputs_last_hour": recent,
        "generation_s_last_hour": round(busy, 3),
        "outputs_per_hour": per_hour,
        "eta_hours": 0.0 if not left else (left / per_hour if per_hour > 0 else None),
        "all_done": left == 0 and len(known) > 0,
        "runs": last_runs(out),
    }
    if arrays := array_counts(out):
        count = arrays[-1]  # of several N (an array resubmitted with another COUNT): the largest one's slices
        tasks: dict[str, Counter] = {}
        for rid, value in state.items():
            tasks.setdefault(f"{shard_index(rid, count)}/{count}", Counter())[value] += 1
        report["array_tasks"] = {
            task: {name: tally[name] if name != "pending" or wanted is not None else None for name in STATES}
            for task, tally in sorted(tasks.items(), key=_task_order)
        }
    return report


def generation_seconds(outputs: Iterable, since: float) -> float:
    """Seconds after `since` in which some output was being generated: each output's span ends when it
    became final and lasts its timings (prepare, denoise, decode, write); overlapping spans (the requests of
    one pass, the ranks) count once, the time no output was in the making (a stop, a requeue) not at all."""
    spans = sorted((max(o.finished - _busy_s(o.record), since), o.finished) for o in outputs)
    total, reach = 0.0, since
    for start, end in spans:
        start = max(start, reach)
        if end > start:
            total += end - start
        reach = max(reach, end)
    return total


def _busy_s(record: dict) -> float:
    timings = record.get("timings") or {}
    values = (timings.get(key) for key in ("prepare_s", "denoise_s", "decode_s", "write_s"))
    return sum(v for v in values if isinstance(v, int | float) and not isinstance(v, bool) and v > 0)


def last_runs(out: Path) -> dict[str, dict]:
    """Per summary file in OUT, the run that wrote it last: when it started, how long it ran, and the job
    counters `--metrics-textfile` ends with (passes, UND passes, weight bytes moved, stall seconds, requests
    skipped as complete). A run that ended on a stalled peer wrote none: the previous run's stays."""
    runs = {}
    for path in sorted(p for p in out.glob("summary*.json") if SUMMARY.fullmatch(p.name)):
        try:
            summary = json.loads(path.read_text())
            ranks = summary["ranks"]  # empty when the run had nothing to do
            runs[path.name] = {
                "started_at": summary["started_at"],
                "wall_s": summary["wall_s"],
                "skipped": summary["skipped_complete"],
                "passes": ranks[0]["passes"] if ranks else 0,  # every rank runs the same passes
                "und_passes": ranks[0]["und_passes"] if ranks else 0,
                "weight_bytes": sum(r["h2d_bytes"] + r["gathered_bytes"] for r in ranks),
                "stall_seconds": round(sum(r["stall_s"] for r in ranks), 6),
            }
        except (OSError, ValueError, KeyError, TypeError):  # not a summary this version wrote: left out
            continue
    return runs


def _state(rid: str, done: dict, rows: dict) -> str:
    if rid in done:
        return "done"
    row = rows.get(rid)
    if row is None:
        return "pending"
    return {"ok": "interrupted"}.get(row["status"], row["status"])  # an ok row without its output: redone


def _task_order(item: tuple[str, Counter]) -> tuple[int, str]:
    index = item[0].split("/")[0]
    return (int(index), item[0]) if index.isdigit() else (-1, item[0])


def array_counts(out: Path) -> list[int]:
    """The COUNTs of the `--shard I/COUNT` runs that wrote to OUT (from their part files' names)."""
    import re

    seen = {int(m[1]) for p in (out / STATE_DIR).glob("metrics.shard*of*-rank*.csv")
            if (m := re.match(r"metrics\.shard\d+of(\d+)-rank", p.name))}  # fmt: skip
    return sorted(seen)


def _shown(count: int | None) -> str:
    return "?" if count is None else str(count)


def describe(report: dict) -> str:
    pending = str(report["pending"]) if report["pending_known"] else "? (give --input)"
    lines = [
        f"{report['out']} ({report['format']}): {report['requests']} requests: {report['done']} done, "
        + (f"{report['blocked']} blocked, " if report.get("blocked") else "")
        + f"{report['failed']} failed, {report['interrupted']} interrupted, {pending} pending"
    ]
    eta = report["eta_hours"]
    when = "-" if eta is None else f"{eta:.2f} h"
    busy = f"{report['generation_s_last_hour']:.0f} s of generation"
    lines.append(f"last hour: {report['outputs_last_hour']} outputs in {busy} "
                 f"({report['outputs_per_hour']:.1f}/hour); ETA {when}")  # fmt: skip
    for task, tally in report.get("array_tasks", {}).items():
        lines.append(f"  array task {task}: " + ", ".join(f"{_shown(tally[n])} {n}" for n in STATES))
    return "\n".join(lines)
