"""The end of a run on every rank: what stopped it, one exit code for all ranks, metrics.csv and summary.json
by rank 0 (the summary on stderr when the disk cannot take it), and the lines the CLI prints.

Every rank computes the code from the same gathered reports, so all ranks return the same one. When ranks
stopped for different reasons, the first kind of `PRECEDENCE` wins everywhere.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import NamedTuple

from cosmos3_batch.config import RunConfig
from cosmos3_batch.io import outputs
from cosmos3_batch.io.manifest import NAME as MANIFEST
from cosmos3_batch.io.manifest import write_manifest
from cosmos3_batch.io.metrics import STATE_DIR, merge_metrics, merge_pending, merged_rows
from cosmos3_batch.io.space import describe_refusal, disk_errno
from cosmos3_batch.parallel.exit_codes import ExitCode
from cosmos3_batch.parallel.stop import PRECEDENCE
from cosmos3_batch.parallel.world import World
from cosmos3_batch.pipeline.job.run_plan import Plan
from cosmos3_batch.pipeline.job.summary import build_summary, describe_summary, summary_name

log = logging.getLogger("cosmos3_batch")

ADVICE = {
    "disk": "free space (or make --out writable) and rerun the same command: it generates exactly the rest",
    "checkpoint": "put the checkpoint back as it was (or point --model at the new one) and rerun: "
    "complete outputs are kept",
}


class Outcome(NamedTuple):
    code: int  # the same on every rank
    line: str | None  # the summary line (stdout), on rank 0
    error: str | None  # one line for stderr, on the rank that prints it


def first_stop(stops: list[dict]) -> dict | None:
    """The stop every rank reports: the first kind of PRECEDENCE that any rank saw, its first occurrence."""
    for kind in PRECEDENCE:
        for stop in stops:
            if stop["kind"] == kind:
                return stop
    return None


def end_run(cfg: RunConfig, world: World, plan: Plan, ranks: list[dict], started: float) -> Outcome:
    failed = {k: v for report in ranks for k, v in report.pop("failed").items()}
    stop = first_stop([s for s in (report.pop("stop") for report in ranks) if s])
    summary = None
    if world.is_main:
        summary = build_summary(cfg, plan, ranks, failed, time.time() - started, world)
        if stop is not None:
            summary["interrupted"] = {
                "reason": stop["kind"],
                "signal": stop["message"] if stop["kind"] == "signal" else "",
                "message": "" if stop["kind"] == "signal" else stop["message"],
                "exit_code": stop["code"],
                # in flight (mid-denoise, or decoded but not written): redone by the next run
                "abandoned": sorted(i for report in ranks for i in report["abandoned"] + report["unwritten"]),
                "not_started": sum(report["not_started"] for report in ranks),
            }
        # Also when nothing ran: rows an earlier run could not merge (a full disk) are merged now.
        merge = bool(ranks) or merge_pending(cfg.out)
        full = write_reports(cfg, summary, merge, plan.requests)
        if failed:
            log.error("%d request(s) failed: %s", len(failed), ", ".join(sorted(failed)))
    # Also the barrier after which summary.json exists; and a disk that filled only now is a full disk.
    full = world.all_gather_object(full if world.is_main else None)[0]
    if stop is None and full is not None:
        stop = {"kind": "disk", "code": ExitCode.DISK, "message": full}
    code = stop["code"] if stop is not None else ExitCode.FAILED if failed else ExitCode.OK
    if not world.is_main:
        return Outcome(int(code), None, None)
    error = None
    if stop is not None and stop["kind"] != "signal":
        error = f"{stop['message']}. {ADVICE[stop['kind']].capitalize()} (exit {int(code)})"
    return Outcome(int(code), describe_summary(summary, cfg.out), error)


def write_reports(cfg: RunConfig, summary: dict, merge: bool, requests=()) -> str | None:
    """metrics.csv, summary.json and manifest.parquet, each as far as the disk allows: a full disk loses
    none of them (the metrics rows stay in their part files, merged by the next run, which also writes the
    manifest; the summary goes to stderr). Returns what a full disk refused (one line), else None."""
    full, rows = None, None if merge else merged_rows(cfg.out)
    if merge:
        try:
            rows = {row["id"]: row for row in merge_metrics(cfg.out)[1]}
        except OSError as exc:
            if (code := disk_errno(exc)) is None:
                raise
            full = describe_refusal(code, cfg.out / "metrics.csv", cfg.out)
            log.error(
                "metrics.csv not merged (%s): every row is kept in %s/ and the next run merges them",
                exc.strerror or exc,
                cfg.out / STATE_DIR,
            )
    name = summary_name(cfg.tag)
    try:
        outputs.write_json(cfg.out / name, summary)
    except OSError as exc:
        if (code := disk_errno(exc)) is None:
            raise
        full = full or describe_refusal(code, cfg.out / name, cfg.out)
        log.error("%s not written (%s); here it is:", name, exc.strerror or exc)
        print(json.dumps(summary, sort_keys=True), file=sys.stderr, flush=True)
    try:  # the requests of this run that have no record yet (a stop) are listed as pending
        # The tag: this run's shards are rewritten without samples it generated again (none when it ran none).
        write_manifest(cfg.out, requests, tag=cfg.tag if requests else None, rows=rows)
    except OSError as exc:
        if (code := disk_errno(exc)) is None:
            raise
        full = full or describe_refusal(code, cfg.out / MANIFEST, cfg.out)
        log.error("%s not written (%s): `cosmos3-batch manifest %s` writes it", MANIFEST, exc, cfg.out)
    return full
