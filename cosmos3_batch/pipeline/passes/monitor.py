"""Rank 0's view of a running job (DESIGN.md §20): the lag warning and `--metrics-textfile`.

Everything comes from the per-pass exchange (pipeline/passes/exchange.py), which already carries each rank's
counts; nothing here issues a collective. A thread wakes every second: it writes the text file every
`--metrics-interval-s` and warns when rank 0 has waited for the others for more than `LAG_SHARE` of
`--collective-timeout-s` (then the job is that far from ending with 69), wherever it waits: the exchange,
a layer part's gather, an `--sp` all-to-all or agreement, a VAE group message (the waits the pass loop and
the finisher mark: parallel/waiting.py), naming the wait as the line that ends the job would. After each
exchange, the ranks' own waits say who came last and how late: a rank that lagged the first by more than
that share is named (once per episode: again only after it has caught up).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from cosmos3_batch.config import RunConfig
from cosmos3_batch.io.prometheus import Snapshot, job_labels, write_textfile
from cosmos3_batch.parallel.waiting import Wait
from cosmos3_batch.pipeline.passes.exchange import Exchanged, PassSync

log = logging.getLogger("cosmos3_batch")
LAG_SHARE = 0.5  # of --collective-timeout-s: a rank this late is named in the log
TICK_S = 1.0


class JobMonitor:
    """From the job's first second: `phase` says validating and loading (no exchange yet: every rank's
    seconds since progress are the phase's, growing while a rank loads slowly); `attach` hands it the pass
    loop's exchange, and from then on its figures are the exchange's."""

    def __init__(
        self,
        sync: PassSync | None,
        timeout_s: float,
        textfile: Path | None = None,
        interval_s: float = 15.0,
        labels: dict[str, str] | None = None,
        requests: tuple[int, int] = (0, 0),
        started: float | None = None,
        world_size: int | None = None,
    ):
        self.sync, self.timeout_s, self.textfile, self.interval_s = sync, timeout_s, textfile, interval_s
        self.labels = labels or {"job": "", "array_task": ""}
        started = time.time() if started is None else started
        self.world_size = sync.world_size if sync is not None else (world_size or 1)
        self.snap = Snapshot(start_time=started, since_progress=[0.0] * self.world_size)
        self.snap.phase = "running" if sync is not None else "validating"
        self._phase_since = time.monotonic()
        self._counts(*requests)
        self.passes = lambda: (0, 0)  # (passes, UND passes): the runner's, once there is one
        self._lock = threading.Lock()
        self._lagging: set[int] = set()
        self._late = [0.0] * self.world_size  # per rank: how far it came after the first to an exchange
        self._waited_warned: dict[int, int] = {}  # per wait mark, the episode last named
        self._window = (time.monotonic(), 0)  # (when, outputs done) at the previous write
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="cosmos3-monitor", daemon=True)

    def _counts(self, to_do: int, skipped: int) -> None:
        self.snap.requests = {"done": 0, "failed": 0, "interrupted": 0, "pending": to_do, "skipped": skipped}

    def start(self) -> JobMonitor:
        if self.textfile is not None:  # at once: a dashboard tells a starting job from one never started
            self.write()
        self._thread.start()
        return self

    def counts(self, to_do: int, skipped: int) -> None:
        """The request counts known before the passes (a job with nothing to do has only these)."""
        with self._lock:
            self._counts(to_do, skipped)

    def phase(self, name: str) -> None:
        """The job entered phase `name` (prometheus.PHASES): written at once."""
        with self._lock:
            self.snap.phase, self._phase_since = name, time.monotonic()
        if self.textfile is not None:
            self.write()

    def attach(self, sync: PassSync, to_do: int, skipped: int) -> None:
        """The pass loop's exchange exists: the lag warnings and the figures come from it from now on."""
        with self._lock:
            self._counts(to_do, skipped)
        sync.last_exchange = time.monotonic()  # no exchange yet: progress counts from the passes' start
        self.sync = sync
        self.phase("running")

    def on_exchange(self, world: Exchanged) -> None:
        """After every exchange, on the loop's thread: the sums so far, and who came late to the last one."""
        with self._lock:
            req = self.snap.requests
            req["done"] += world.finished - world.failed
            req["failed"] += world.failed
            req["pending"] = world.pending + world.active
            self.snap.weight_bytes += world.weight_bytes
            self.snap.stall_seconds += world.stall_s
        if world.waited_s:
            self._name_laggards(world.waited_s)

    def _name_laggards(self, waited: tuple[float, ...]) -> None:
        limit = LAG_SHARE * self.timeout_s
        first = max(waited)  # the first to arrive waited longest
        late = [first - wait for wait in waited]
        with self._lock:
            self._late = late
        for rank, lag in enumerate(late):
            if lag > limit and rank not in self._lagging:
                self._lagging.add(rank)
                log.warning(
                    "rank %d reached per-pass exchange %d %.1f s after the first rank (over %.0f%% of "
                    "--collective-timeout-s %g: at the timeout the job ends with 69)",
                    rank, max(self.sync.all_reduces - 1, 1), lag, 100 * LAG_SHARE, self.timeout_s,
                )  # fmt: skip
            elif lag <= limit / 2:
                self._lagging.discard(rank)  # caught up: a new episode may be named again

    def _watch(self) -> None:
        last_write = time.monotonic()
        tick = min(TICK_S, self.interval_s)  # an interval under a tick is honoured, not rounded up to it
        while not self._stop.wait(tick):
            self._name_long_wait()
            if self.textfile is not None and time.monotonic() - last_write >= self.interval_s:
                self.write()
                last_write = time.monotonic()

    def _name_long_wait(self) -> None:
        """Each wait of rank 0 (the loop's, the finisher's: `PassSync.marks`) past the share, said once."""
        for mark in self.sync.marks if self.sync is not None else ():
            wait = mark.state  # read once: the loop may end this wait and begin another meanwhile
            if wait is None or wait.episode == self._waited_warned.get(id(mark)):
                continue
            waited = time.monotonic() - wait.since
            if waited > LAG_SHARE * self.timeout_s:
                self._waited_warned[id(mark)] = wait.episode
                self._say_wait(wait, waited)

    def _say_wait(self, wait: Wait, waited: float) -> None:
        world, number = self.sync.world_size, max(self.sync.all_reduces - 1, 0)
        who = wait.who or ("rank 1" if world == 2 else f"one or more of ranks 1-{world - 1}")
        log.warning(
            "rank 0 has waited %.0f s for %s at pass %d, %s (at --collective-timeout-s %g the job ends "
            "with 69)", waited, who, number, wait.what, self.timeout_s,
        )  # fmt: skip

    def figures(self) -> Snapshot:
        """The snapshot as of now: per rank, seconds since it last reached the per-pass exchange."""
        now = time.monotonic()
        with self._lock:
            snap = Snapshot(**{**self.snap.__dict__, "requests": dict(self.snap.requests)})
            late = list(self._late)
        snap.passes, snap.und_passes = self.passes()
        if self.sync is None:  # validating, loading: no exchange yet; a phase's length is its progress
            snap.since_progress = [now - self._phase_since] * self.world_size
        else:  # each rank's own: the time since the last exchange, plus how late it came to the one before
            since = now - self.sync.last_exchange
            snap.since_progress = [since + lag for lag in late]
            if self.sync.waiting_since is not None:  # rank 0 is at the exchange: it is not what is awaited
                snap.since_progress[0] = 0.0
        then, before = self._window
        self._window = (now, snap.requests["done"])
        snap.outputs_per_second = (snap.requests["done"] - before) / (now - then) if now > then else 0.0
        return snap

    def write(self) -> None:
        try:
            write_textfile(self.textfile, self.figures(), self.labels)
        except OSError as exc:  # a metrics file never stops the job
            log.warning("--metrics-textfile %s not written: %s", self.textfile, exc)

    def close(self, final: dict[str, int] | None = None) -> None:
        """Stop the thread; the last write, with the counts of the end-of-run reports when there are some."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        with self._lock:
            if final is not None:
                self.snap.requests.update(final)
            self.snap.running, self.snap.phase = False, "ending"
        if self.textfile is not None:
            self.write()


def final_counts(ranks: list[dict]) -> dict[str, int]:
    """The request counts of the end-of-run reports (pipeline/job/summary.py rank_report), exact."""
    return {
        "done": sum(r["ok"] for r in ranks),
        "failed": sum(len(r["failed"]) for r in ranks),
        "interrupted": sum(len(r["abandoned"]) + len(r["unwritten"]) for r in ranks),
        "pending": sum(r["not_started"] for r in ranks),
    }


def start_monitor(cfg: RunConfig, world_size: int, started: float) -> JobMonitor:
    """Rank 0's monitor from the job's start (phase validating); `attach` it to the pass loop's exchange."""
    labels = job_labels(dict(os.environ), cfg.shard)
    textfile, interval = cfg.metrics_textfile, cfg.metrics_interval_s
    return JobMonitor(
        None, cfg.collective_timeout_s, textfile, interval, labels, started=started, world_size=world_size
    ).start()
