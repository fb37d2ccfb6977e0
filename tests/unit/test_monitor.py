"""Rank 0's monitor (pipeline/passes/monitor.py): a rank that came late to an exchange by more than half the
collective timeout is named once per episode; rank 0 waiting that long (in an exchange, for a layer part's
gather, in an --sp all-to-all, for a VAE group message) is said while it waits, once per wait, naming the
wait; the figures it writes parse back with prometheus_client's parser."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import torch
from prometheus_client.parser import text_string_to_metric_families

from cosmos3_batch.engine.transport import OffloadMode
from cosmos3_batch.model.cosmos3 import GEN, UND, part_index
from cosmos3_batch.model.vae_patch import Shard
from cosmos3_batch.parallel import seq_group
from cosmos3_batch.parallel.seq_group import SeqGroup
from cosmos3_batch.parallel.vae_group import PatchGroup
from cosmos3_batch.parallel.waiting import WaitMark
from cosmos3_batch.pipeline.passes import exchange
from cosmos3_batch.pipeline.passes.exchange import Exchanged, PassSync
from cosmos3_batch.pipeline.passes.monitor import JobMonitor
from cosmos3_batch.pipeline.passes.weights import OffloadedWeights
from cosmos3_batch.plan.prefill import SlotReport


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


class Stall:
    """Inside a wait: backdate the mark's start by `seconds` (as if it had blocked that long) and let the
    monitor look twice, as its thread would on two ticks. No clock is raced: the wait is as long as said."""

    def __init__(self, monitor: JobMonitor, mark: WaitMark, seconds: float = 16.0):
        self.monitor, self.mark, self.seconds = monitor, mark, seconds
        self.looked = 0

    def __call__(self, *args, **kwargs) -> None:
        state = self.mark.state
        assert state is not None, "the wait is not marked"
        self.mark.state = state._replace(since=state.since - self.seconds)
        self.monitor._name_long_wait()
        self.monitor._name_long_wait()  # the same wait: said once
        self.looked += 1


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_rank_0_waiting_half_the_timeout_in_an_exchange_is_said_while_it_waits(caplog, monkeypatch):
    sync = PassSync(world_size=2)
    sync.all_reduces = 7
    monitor = JobMonitor(sync, timeout_s=30)
    stall = Stall(monitor, sync.waiting)
    monkeypatch.setattr(exchange.dist, "all_reduce", stall)
    with caplog.at_level(logging.WARNING, logger="cosmos3_batch"):
        sync.exchange(0, SlotReport(0, 0, 0), False, 0)
        monitor._name_long_wait()  # the exchange is over: nothing is waited for
    assert stall.looked == 1 and sync.waiting.state is None
    assert warnings(caplog) == [
        "rank 0 has waited 16 s for rank 1 at pass 7, the per-pass exchange (at --collective-timeout-s 30 "
        "the job ends with 69)"
    ]


def test_rank_0_waiting_for_a_gather_past_the_share_is_named_once_per_wait(caplog):
    """The compute thread's wait for a part (its gather runs on the fetch worker): one warning naming the
    gather and the pass, as the line that ends the job would; none for a wait that ends in time."""
    sync = PassSync(world_size=2)
    sync.all_reduces = 24  # in pass 23
    monitor = JobMonitor(sync, timeout_s=30)
    stall, waits = Stall(monitor, sync.waiting), []

    def acquire(part: int) -> None:
        waits.append(sync.waiting.state)
        monitor._name_long_wait()  # in time: just begun
        if part == part_index(1, GEN):
            stall()

    source = SimpleNamespace(mode=OffloadMode.ALLGATHER, world_size=2)
    engine = SimpleNamespace(source=source, config=SimpleNamespace(world_size=2), acquire=acquire)
    weights = OffloadedWeights(engine, torch.nn.ModuleList([torch.nn.Identity()] * 3), sync.waiting)
    with caplog.at_level(logging.WARNING, logger="cosmos3_batch"):
        for index in range(3):
            weights.layer(index, UND)
            weights.layer(index, GEN)
        monitor._name_long_wait()
    assert warnings(caplog) == [
        "rank 0 has waited 16 s for rank 1 at pass 23, the gather of layer 1's GEN part (at "
        "--collective-timeout-s 30 the job ends with 69)"
    ]
    assert [w.what for w in waits[:2]] == [
        "the gather of layer 0's UND part (a prefill pass)",
        "the gather of layer 0's GEN part",
    ]
    assert len({w.episode for w in waits}) == 6 and sync.waiting.state is None
    with caplog.at_level(logging.WARNING, logger="cosmos3_batch"):  # a later stall is a new episode
        engine.acquire = stall
        weights.layer(0, GEN)
    assert len(warnings(caplog)) == 2 and "layer 0's GEN part" in warnings(caplog)[1]
    read = SimpleNamespace(mode=OffloadMode.LOCAL, world_size=2)
    local = SimpleNamespace(source=read, config=engine.config)
    assert OffloadedWeights(local, weights.layers, sync.waiting).mark is None  # a local read awaits no peer


def test_rank_0_waiting_in_an_sp_all_to_all_or_a_vae_group_message_is_named(caplog, monkeypatch):
    sync = PassSync(world_size=4)
    sync.all_reduces = 3
    monitor = JobMonitor(sync, timeout_s=10)
    group = SeqGroup(2, 0, 0, mark=sync.waiting)
    stall = Stall(monitor, sync.waiting, seconds=6)
    monkeypatch.setattr(seq_group.dist, "all_to_all_single", stall)
    finisher = WaitMark("the finisher")
    sync.marks.append(finisher)
    work = SimpleNamespace(wait=Stall(monitor, finisher, seconds=5.5))
    decode = PatchGroup(SimpleNamespace(recv=lambda *a: work), 0, 2, 2, mark=finisher)
    with caplog.at_level(logging.WARNING, logger="cosmos3_batch"):
        group.all_to_all_rows(torch.zeros(2, 3), [1, 1], [1, 1])
        decode.bind(Shard(3, (2, 2), 0)).collect(torch.zeros(1, 1, 1, 2, 2), 3)
    assert warnings(caplog) == [
        "rank 0 has waited 6 s for rank 1 at pass 2, an --sp all-to-all (at --collective-timeout-s 10 the "
        "job ends with 69)",
        "rank 0 has waited 6 s for rank 1 at pass 2, a VAE group exchange (decode) (at "
        "--collective-timeout-s 10 the job ends with 69)",
    ]
    assert sync.waiting.state is None and finisher.state is None


def test_the_figures_say_rank_0_is_waiting_and_its_peers_are_awaited():
    sync = PassSync(world_size=2)
    sync.waiting_since = time.monotonic() - 16
    snap = JobMonitor(sync, timeout_s=30).figures()
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


def _phase_and_since(path):
    found = {f.name: f for f in text_string_to_metric_families(path.read_text())}
    phase = {s.labels["phase"]: s.value for s in found["cosmos3_batch_phase"].samples}
    since = [s.value for s in found["cosmos3_batch_rank_seconds_since_progress"].samples]
    return [name for name, on in phase.items() if on == 1.0], since, found["cosmos3_batch_running"].samples


def test_the_textfile_is_there_from_the_jobs_first_second_phase_by_phase(tmp_path, monkeypatch):
    """Issue 43: written at start (validating), again at each phase, growing seconds since progress while a
    rank loads, then the exchange's figures once the passes run, and `ending` with running 0."""
    path = tmp_path / "m.prom"
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    monitor = JobMonitor(None, 30, path, interval_s=3600, world_size=2)
    monitor.start()  # its thread writes only every interval: what is on disk now is start's own write
    phases, since, running = _phase_and_since(path)
    assert phases == ["validating"] and since == [0.0, 0.0] and running[0].value == 1.0
    monitor.phase("loading")
    clock[0] += 42.0  # a slow cold read
    monitor.write()
    phases, since, _ = _phase_and_since(path)
    assert phases == ["loading"] and since == [42.0, 42.0]
    sync = PassSync(world_size=2)
    monitor.attach(sync, 5, 1)
    phases, since, _ = _phase_and_since(path)
    assert phases == ["running"] and since == [0.0, 0.0]  # the exchange's: just made
    monitor.phase("ending")
    monitor.close()
    phases, _, running = _phase_and_since(path)
    assert phases == ["ending"] and running[0].value == 0.0


def test_a_wait_inside_a_wait_gives_the_outer_one_back():
    mark = WaitMark()
    with mark.waiting("a host read of the device (the step cache's distances)"):
        outer = mark.state
        with mark.waiting("an --sp agreement"):
            assert mark.state.what == "an --sp agreement"
        assert mark.state == outer  # the outer wait is still being waited
    assert mark.state is None


def test_each_rank_has_its_own_seconds_since_progress_and_the_late_one_is_named_at_world_4(caplog):
    """Issue 43: the per-rank waits the exchange already carries say which rank kept the others waiting; its
    seconds since progress exceed the others' by exactly its lag, and the lag warning names it, not a
    neighbour."""
    sync = PassSync(world_size=4)
    monitor = JobMonitor(sync, timeout_s=20)
    with caplog.at_level(logging.WARNING, logger="cosmos3_batch"):
        monitor.on_exchange(exchanged((12.5, 12.0, 0.5, 12.25)))  # rank 2 arrived 12 s after rank 0
    assert [line.split()[:2] for line in warnings(caplog)] == [["rank", "2"]]
    sync.last_exchange = time.monotonic() - 3.0
    since = monitor.figures().since_progress
    lags = [round(s - since[0], 6) for s in since]
    assert lags == [0.0, 0.5, 12.0, 0.25] and since[0] >= 3.0
    sync.waiting_since = time.monotonic()  # rank 0 is back at the exchange: it is not what is awaited
    since = monitor.figures().since_progress
    assert since[0] == 0.0 and round(since[2] - since[1], 6) == 11.5


def test_an_interval_under_the_tick_is_honoured(tmp_path):
    """--metrics-interval-s 0.1 writes every 0.1 s: the watch loop waits the interval when it is shorter than
    its tick (it waited a whole tick before, so any interval under a second wrote once a second)."""
    from cosmos3_batch.pipeline.passes.monitor import TICK_S

    waits = []
    for interval in (0.1, 15.0):
        monitor = JobMonitor(None, 30, tmp_path / "m.prom", interval_s=interval, world_size=2)
        monitor._stop = SimpleNamespace(wait=lambda timeout: waits.append(timeout) or True)  # stop at once
        monitor._watch()
    assert waits == [0.1, TICK_S]
