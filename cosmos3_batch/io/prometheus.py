"""`run --metrics-textfile PATH`: the job's live figures in the Prometheus text format (docs/running.md has
every name), for the node exporter's textfile collector. Written whole to a temporary file and renamed
(`prometheus_client.write_to_textfile`), so a scrape never reads half a file."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "cosmos3_batch_"
LABELS = ("job", "array_task")
STATES = ("done", "failed", "interrupted", "pending", "skipped")
PHASES = ("validating", "loading", "running", "ending")  # a job's phases, in order
HELP = {  # docs/running.md lists the same
    "requests": "Requests of this job by state (skipped: already complete when it started)",
    "outputs_per_second": "Outputs written per second over the window since the previous write",
    "passes": "Passes run",
    "und_passes": "Passes that fetched the UND (text) parts",
    "weight_bytes": "Weight bytes moved host to device and gathered, all ranks",
    "stall_seconds": "Seconds compute waited for a layer part, summed over ranks",
    "job_start_time_seconds": "When the job started, unix time",
    "running": "1 while the job runs, 0 once it has ended",
    "phase": "1 for the phase the job is in (validating, loading, running, ending), 0 for the others",
    "rank_seconds_since_progress": "Seconds since the last per-pass exchange, plus how late the rank came "
    "to the one before it (rank 0 counts 0 while it waits there for the others); before the passes, since "
    "the phase began",
}


@dataclass
class Snapshot:
    """The figures of one write (rank 0's view: sums over ranks as of the last per-pass exchange)."""

    requests: dict[str, int] = field(default_factory=dict)  # STATES -> count
    outputs_per_second: float = 0.0  # over the window since the previous write
    passes: int = 0
    und_passes: int = 0
    weight_bytes: int = 0
    stall_seconds: float = 0.0
    since_progress: list[float] = field(default_factory=list)  # per rank
    start_time: float = 0.0  # unix seconds
    running: bool = True
    phase: str = PHASES[0]


def job_labels(environ: dict, shard: tuple[int, int] | None) -> dict[str, str]:
    """job: Slurm's job id (an array's own id, so every task shares it), else torchrun's run id, else "";
    array_task: Slurm's array task id, else the --shard index, else ""."""
    ids = ("SLURM_ARRAY_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")
    job = next((environ[name] for name in ids if environ.get(name)), "")
    task = environ.get("SLURM_ARRAY_TASK_ID") or ("" if shard is None else str(shard[0]))
    return {"job": job, "array_task": task}


class _Figures:
    """A collector that yields one snapshot's families (prometheus_client calls `collect` on write)."""

    def __init__(self, snap: Snapshot, labels: dict[str, str]):
        self.snap, self.values = snap, [labels[name] for name in LABELS]

    def collect(self) -> Iterator:
        s, labels, values = self.snap, list(LABELS), self.values
        requests = GaugeMetricFamily(PREFIX + "requests", HELP["requests"], labels=[*labels, "state"])
        for state in STATES:
            requests.add_metric([*values, state], s.requests.get(state, 0))
        yield requests
        singles = (
            (GaugeMetricFamily, "outputs_per_second", s.outputs_per_second),
            (CounterMetricFamily, "passes", s.passes),
            (CounterMetricFamily, "und_passes", s.und_passes),
            (CounterMetricFamily, "weight_bytes", s.weight_bytes),
            (CounterMetricFamily, "stall_seconds", s.stall_seconds),
            (GaugeMetricFamily, "job_start_time_seconds", s.start_time),
            (GaugeMetricFamily, "running", float(s.running)),
        )
        for kind, name, value in singles:
            family = kind(PREFIX + name, HELP[name], labels=labels)
            family.add_metric(values, value)
            yield family
        phase = GaugeMetricFamily(PREFIX + "phase", HELP["phase"], labels=[*labels, "phase"])
        for name in PHASES:
            phase.add_metric([*values, name], float(name == s.phase))
        yield phase
        since = PREFIX + "rank_seconds_since_progress"
        family = GaugeMetricFamily(since, HELP["rank_seconds_since_progress"], labels=[*labels, "rank"])
        for rank, seconds in enumerate(s.since_progress):
            family.add_metric([*values, str(rank)], seconds)
        yield family


def write_textfile(path: Path, snap: Snapshot, labels: dict[str, str]) -> None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Figures(snap, labels))
    write_to_textfile(str(path), registry)
