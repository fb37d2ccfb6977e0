"""Rank 0's monitor (pipeline/monitor.py): a rank that came late to an exchange by more than half the
collective timeout is named once per episode; rank 0 waiting that long in an exchange is said while it
waits; the figures it writes parse back with prometheus_client's parser."""

from __future__ import annotations

import logging
import time

from prometheus_client.parser import text_string_to_metric_families

from cosmos3_batch.pipeline.exchange import Exchanged, PassSync
from cosmos3_batch.pipeline.monitor import JobMonitor


def exchanged(waited: tuple[float, ...], finished: int = 0, failed: int = 0) -> Exchanged:
    return Exchanged(2, 0, 0, 5, False, finished, False, failed, 1000, 0.25, waited)


def test_a_rank_late_to_an_exchange_is_named_once_per_episode(caplog):
    monitor = JobMonitor(PassSync(world_size=3), timeout_s=30)
    with caplog.at_level(logging.WARNING, logger="cosmos3_batch"):
        monitor.on_exchange(exchanged((16.0, 16.2, 0.1)))  # rank 2 came 16.1 s after rank 1: > 15 s
        monitor.on_exchange(exchanged((17.0, 17.0, 0.0)))  # still late: the same episode
        monitor.on_exchange(exchanged((4.0, 4.0, 0.0)))  # under half the limit: caught up
        monitor.on_exchange(exchanged((0.0, 0.0, 0.0)))
        monitor.on_exchange(exchanged((0.0, 20.0, 0.0)))  # late again (ranks 0 and 2 this time)
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split()[:2] for line in lines] == [["rank", "2"], ["rank", "0"], ["rank", "2"]], lines
    assert lines[0] == (
        "rank 2 reached per-pass exchange 1 16.1 s after the first rank (over 50% of --collective-timeout-s "
        "30: at the timeout the job ends with 69)"
    )


def test_rank_0_waiting_half_the_timeout_in_an_exchange_is_said_while_it_waits(caplog):
    sync = PassSync(world_size=2)
    sync.all_reduces, sync.waiting_since = 8, time.monotonic() - 16
    monitor = JobMonitor(sync, timeout_s=30)
    with caplog.at_level(logging.WARNING, logger="cosmos3_batch"):
        monitor._name_long_wait()
        monitor._name_long_wait()  # the same wait: said once
    assert [r.getMessage() for r in caplog.records] == [
        "rank 0 has waited 16 s in pass 7's exchange for rank 1 (at --collective-timeout-s 30 the job ends "
        "with 69)"
    ]
    snap = monitor.figures()
    assert snap.since_progress[0] == 0.0 and snap.since_progress[1] > 0  # rank 0 waits; rank 1 is awaited


def test_the_textfile_parses_back_with_the_counts_and_labels(tmp_path):
    path = tmp_path / "m.prom"
    monitor = JobMonitor(
        PassSync(world_size=2), 30, path, labels={"job": "4242", "array_task": "3"}, requests=(10, 2)
    )
    monitor.passes = lambda: (7, 1)
    monitor.on_exchange(exchanged((0.0, 0.0), finished=3, failed=1))
    monitor.close()
    found = {f.name: f for f in text_string_to_metric_families(path.read_text())}
    requests = {s.labels["state"]: s.value for s in found["cosmos3_batch_requests"].samples}
    assert requests == {"done": 2, "failed": 1, "interrupted": 0, "pending": 7, "skipped": 2}
    assert found["cosmos3_batch_passes"].type == "counter"
    assert found["cosmos3_batch_passes"].samples[0].value == 7
    assert found["cosmos3_batch_und_passes"].samples[0].value == 1
    assert found["cosmos3_batch_weight_bytes"].samples[0].value == 1000
    assert found["cosmos3_batch_stall_seconds"].samples[0].value == 0.25
    assert found["cosmos3_batch_running"].samples[0].value == 0
    assert found["cosmos3_batch_running"].samples[0].labels == {"job": "4242", "array_task": "3"}
    ranks = found["cosmos3_batch_rank_seconds_since_progress"].samples
    assert [s.labels["rank"] for s in ranks] == ["0", "1"]
    assert not list(tmp_path.glob("*.tmp*")), "written through a temporary and renamed"
