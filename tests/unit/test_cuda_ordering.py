"""The CUDA backend's stream/event ordering and event timing, on CPU with stand-in streams and events.

The stand-ins simulate CUDA semantics on a clock: each stream runs its work in issue order, an op
advances its stream's clock by a fixed duration, `wait_event` holds a stream until the event's time, an
event takes its stream's time when recorded. The real `LayerOffload` drives the real `CudaBackend`; only
the copy and gather calls are replaced by ones that log and advance their stream's clock.

What must hold (see cuda_backend.py and slots.py):
- per fetch: the copy waits until the slot's last reader ran; the gather waits for the copy; compute
  waits for the gather; no host-side waits and no device-wide synchronize;
- stall, compute, collective and copy times come from event pairs (equal to the simulated idle and busy
  times exactly) and are read once per pass, without blocking, once the pass's events completed;
- on a UND pass no GEN fetch waits for a UND compute, nor for the GEN compute just before it;
- the first GEN part of pass p+1 is fetched before pass p ends.
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from cosmos3_batch.checkpoint.reader import TensorStore
from cosmos3_batch.engine import cuda_backend
from cosmos3_batch.engine.offload import LayerOffload, OffloadConfig, PartBinding
from cosmos3_batch.engine.transport import OffloadMode

LAYERS = 4
COPY_MS, GATHER_MS = 2.0, 3.0
COMPUTE_MS = {"und": 1.0, "gen": 7.0}
UND_PASS = [i for layer in range(LAYERS) for i in (2 * layer, 2 * layer + 1)]
GEN_PASS = [2 * layer + 1 for layer in range(LAYERS)]


class FakeCuda:
    """torch.cuda as the backend uses it: streams, events (timing or not), the `stream` context."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.current = None
        self.device_now = math.inf  # events recorded at or before this time have completed
        self.idle_ms = 0.0  # time the compute stream sat in waits for a part (the true stall)
        self.elapsed_calls = 0
        self._names = iter(["copy", "comm"])

    class _Stream:
        def __init__(self, owner, name):
            self.owner, self.name, self.t = owner, name, 0.0

        def wait_event(self, event):
            self.owner.log.append(("wait", self.name, event))
            if event.t is not None and event.t > self.t:
                if self.name == "compute" and event in self.owner.ready_events:
                    self.owner.idle_ms += event.t - self.t
                self.t = event.t

        def synchronize(self):
            self.owner.log.append(("host_wait", self.name))

    class _Event:
        def __init__(self, owner, timing):
            self.owner, self.timing, self.t = owner, timing, None

        def record(self, stream):
            self.t = stream.t
            self.owner.log.append(("record", stream.name, self))

        def query(self):
            return self.t is not None and self.t <= self.owner.device_now

        def synchronize(self):
            self.owner.log.append(("host_wait", self))

        def elapsed_time(self, end):
            assert self.timing and end.timing, "elapsed_time needs timing events"
            assert self.query() and end.query(), "read before the events completed"
            self.owner.elapsed_calls += 1
            return end.t - self.t

    def current_stream(self, device):
        self.compute = self._Stream(self, "compute")
        self.current = self.compute
        return self.compute

    def Stream(self, device, priority=0):
        stream = self._Stream(self, next(self._names))
        stream.priority = priority
        return stream

    def Event(self, enable_timing=False):
        return self._Event(self, enable_timing)

    @contextmanager
    def stream(self, stream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    @property
    def ready_events(self):
        return self.backend.ready


class Part(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(16))


def make_engine(tmp_path, monkeypatch, lanes=(("gen", 2), ("und", 1)), lane_of=lambda key: key, world=2):
    """The real LayerOffload (rank 0 of `world`) with a CudaBackend on stand-ins; copy/gather only log."""
    with torch.device("meta"):
        parts = {f"{layer}.{key}": Part() for layer in range(LAYERS) for key in ("und", "gen")}
    save_file({f"{key}.w": torch.randn(16) for key in parts}, str(tmp_path / "m.safetensors"))
    bindings = [
        PartBinding(key, ((p, "w", f"{key}.w"),), lane=lane_of(key.split(".")[1])) for key, p in parts.items()
    ]
    config = OffloadConfig(OffloadMode.ALLGATHER, 0, 1, lane_slots=lanes)
    engine = LayerOffload(bindings, TensorStore(tmp_path), config, torch.device("cpu"))
    engine.backend.close(1.0)
    fake = FakeCuda()
    engine.source.world_size = world  # pretend to be one of `world` ranks: the backend then gathers

    def copy_in(src, index, slot, non_blocking):
        assert non_blocking
        fake.log.append(("copy", fake.current.name, index))
        fake.current.t += COPY_MS

    def gather(src, index, slot):
        fake.log.append(("gather", fake.current.name, index))
        fake.current.t += GATHER_MS

    monkeypatch.setattr(cuda_backend, "copy_in", copy_in)
    monkeypatch.setattr(cuda_backend, "gather", gather)
    engine.backend = cuda_backend.CudaBackend(engine.source, engine.slots, "cpu", cuda=fake)
    fake.backend = engine.backend
    return engine, fake


def run_pass(engine, fake, order, prefetch=(1,)):
    """What the runner does with the weights: begin, acquire + compute each part, end, then finish."""
    engine.begin_pass(order, prefetch=prefetch)
    for index in order:
        engine.acquire(index)
        lane = "und" if index % 2 == 0 else "gen"
        fake.log.append(("compute", index))
        fake.compute.t += COMPUTE_MS[lane]
    counters = engine.end_pass()
    fake.log.append(("finish",))
    return counters


def gating(log):
    """For each fetch (copy entry, in log order): (part, position of the latest compute it waits for,
    through the events the copy stream waited on before it (a stream runs in order, so every earlier wait
    counts too), whether the part is computed later in the log (False: a prefetch for the next pass))."""
    last_compute, freed_after, gate, out = None, {}, -1, []
    computes = [e[1] for e in log if e[0] == "compute"]
    for at, entry in enumerate(log):
        if entry[0] == "compute":
            last_compute = entry[1]
        elif entry[0] == "record" and entry[1] == "compute":
            freed_after[id(entry[2])] = last_compute  # a slot_free (or timing) event: after this compute
        elif entry[0] == "wait" and entry[1] == "copy" and freed_after.get(id(entry[2])) is not None:
            gate = max(gate, position(computes, freed_after[id(entry[2])]))
        elif entry[0] == "copy":
            out.append((entry[2], gate, ("compute", entry[2]) in log[at:]))
    return out


def position(computes, index):
    """Global compute position of the most recent compute of part `index` seen so far."""
    return len(computes) - 1 - computes[::-1].index(index)


def test_each_fetch_is_fenced_on_the_streams(tmp_path, monkeypatch):
    engine, fake = make_engine(tmp_path, monkeypatch)
    run_pass(engine, fake, UND_PASS)
    log, backend = fake.log, engine.backend
    assert not [e for e in log if e[0] == "host_wait"]  # nothing blocks the host
    for index in UND_PASS:
        copy = log.index(("copy", "copy", index))
        copied = next(
            i
            for i in range(copy, len(log))
            if log[i][:2] == ("record", "copy") and log[i][2] in backend.copied
        )
        event = log[copied][2]
        waited = next(i for i in range(copied, len(log)) if log[i] == ("wait", "comm", event))
        gathered = log.index(("gather", "comm", index))
        ready = next(
            i
            for i in range(gathered, len(log))
            if log[i][:2] == ("record", "comm") and log[i][2] in backend.ready
        )
        used = next(i for i in range(ready, len(log)) if log[i] == ("wait", "compute", log[ready][2]))
        assert copy < copied < waited < gathered < ready < used < log.index(("compute", index))


def test_copy_and_comm_streams_have_high_priority(tmp_path, monkeypatch):
    """Compute waits for them: under load their kernels must go first (a decode shares the device)."""
    engine, _ = make_engine(tmp_path, monkeypatch)
    backend = engine.backend
    assert (backend.copy_stream.priority, backend.comm_stream.priority) == (cuda_backend.HIGH_PRIORITY,) * 2
    assert cuda_backend.HIGH_PRIORITY < 0  # CUDA: lower numbers are higher priorities


def test_one_device_connection_is_warned_about():
    from cosmos3_batch.parallel.world import connections_warning

    assert "serializes all CUDA streams" in connections_warning({"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert (
        connections_warning({"CUDA_DEVICE_MAX_CONNECTIONS": "8"}) is None and connections_warning({}) is None
    )


def test_no_gen_fetch_waits_on_a_und_compute(tmp_path, monkeypatch):
    engine, fake = make_engine(tmp_path, monkeypatch)
    run_pass(engine, fake, UND_PASS)
    computes = [e[1] for e in fake.log if e[0] == "compute"]
    checked = 0
    for index, gate, this_pass in gating(fake.log):
        if index % 2 == 1 and gate >= 0:  # a GEN part whose fetch waited for a compute of this pass
            assert computes[gate] % 2 == 1, f"GEN part {index} waits on UND part {computes[gate]}'s compute"
            # ... nor on the GEN part just before it: G_{l+1} is in flight while U_l and G_l compute.
            if this_pass:
                assert gate <= computes.index(index) - 4, f"GEN part {index} waits on part {computes[gate]}"
            checked += 1
    assert checked == LAYERS - 1  # G2, G3 and the next pass's G0 waited for a GEN compute; G0, G1 for none


def test_the_check_catches_two_shared_slots(tmp_path, monkeypatch):
    # The old layout (UND and GEN parts in one pool of two slots): G_{l+1} waits for G_l's compute.
    engine, fake = make_engine(tmp_path, monkeypatch, lanes=(), lane_of=lambda key: "main")
    run_pass(engine, fake, UND_PASS, prefetch=())
    computes = [e[1] for e in fake.log if e[0] == "compute"]
    exposed = [
        i for i, gate, _ in gating(fake.log) if i % 2 == 1 and gate >= 0 and gate > computes.index(i) - 4
    ]
    assert exposed == [3, 5, 7]  # every GEN part after the first two


def test_stall_and_busy_times_come_from_event_pairs(tmp_path, monkeypatch):
    engine, fake = make_engine(tmp_path, monkeypatch)
    counters = run_pass(engine, fake, UND_PASS)
    fetched = len(UND_PASS)
    # Exactly the simulated idle time of the compute stream in its waits, and the busy times of each stream.
    # (Event times are milliseconds; counters hold seconds: compared up to float rounding.)
    assert fake.idle_ms > 0
    assert counters.stall_s * 1000 == pytest.approx(fake.idle_ms, rel=1e-12)
    assert counters.compute_s * 1000 == pytest.approx(
        LAYERS * (COMPUTE_MS["und"] + COMPUTE_MS["gen"]), rel=1e-12
    )
    assert counters.collective_s * 1000 == pytest.approx(fetched * GATHER_MS, rel=1e-12)
    assert counters.h2d_s * 1000 == pytest.approx(fetched * COPY_MS, rel=1e-12)
    # Read once: one elapsed_time per pair (stall and compute per part, copy and gather per fetch).
    assert fake.elapsed_calls == 4 * fetched
    assert not [e for e in fake.log if e[0] == "host_wait"]


def test_times_wait_for_their_events_and_arrive_once(tmp_path, monkeypatch):
    engine, fake = make_engine(tmp_path, monkeypatch)
    fake.device_now = 0.0  # the device has not run the pass yet: nothing may be read
    first = run_pass(engine, fake, UND_PASS)
    assert (first.stall_s, first.compute_s, fake.elapsed_calls) == (0.0, 0.0, 0)
    assert first.fetches == len(UND_PASS)  # bytes and fetches do not wait for the device
    fake.device_now = math.inf
    second = run_pass(engine, fake, GEN_PASS)
    both = LAYERS * (COMPUTE_MS["und"] + COMPUTE_MS["gen"]) + LAYERS * COMPUTE_MS["gen"]
    assert second.compute_s * 1000 == pytest.approx(
        both, rel=1e-12
    )  # the first pass's times come with the second's, once
    assert run_pass(engine, fake, GEN_PASS).compute_s * 1000 == pytest.approx(
        LAYERS * COMPUTE_MS["gen"], rel=1e-12
    )


def test_next_pass_first_gen_part_is_in_flight_before_the_pass_finishes(tmp_path, monkeypatch):
    engine, fake = make_engine(tmp_path, monkeypatch)
    for number, order in enumerate((UND_PASS, GEN_PASS, UND_PASS, GEN_PASS)):
        start = len(fake.log)
        run_pass(engine, fake, order)
        tail = fake.log[start:]
        # Part 1 (layer 0's GEN half) for the next pass: its copy is issued during this pass, after this
        # pass acquired its own part 1 and before the runner's finish work.
        copies = [i for i, e in enumerate(tail) if e == ("copy", "copy", 1)]
        used = tail.index(("compute", 1))
        assert [i for i in copies if i > used] and max(copies) < tail.index(("finish",))
        # From the second pass on, this pass's own part 1 came from the pass before.
        assert len(copies) == (2 if number == 0 else 1)
    # Consumed fetches only: the prefetched part counts in the pass that uses it.
    assert [run_pass(engine, fake, GEN_PASS).fetches for _ in range(2)] == [LAYERS, LAYERS]


def test_a_und_only_pass_leaves_the_prefetched_gen_part_for_the_next_gen_pass(tmp_path, monkeypatch):
    """A pass without GEN work (reasoners alone) fetches the UND parts only and prefetches nothing; the GEN
    part 0 prefetched by the GEN pass before it stays in its slot, fetched once, for the next GEN pass."""
    engine, fake = make_engine(tmp_path, monkeypatch)
    und_only = [2 * layer for layer in range(LAYERS)]
    run_pass(engine, fake, GEN_PASS)
    start = len(fake.log)
    counters = [run_pass(engine, fake, und_only, prefetch=()) for _ in range(2)]
    copies = [e[2] for e in fake.log[start:] if e[0] == "copy"]
    assert copies == und_only * 2 and [c.fetches for c in counters] == [LAYERS, LAYERS]
    assert engine.scheduler.outstanding("gen") == [1]
    with pytest.raises(RuntimeError, match="prefetched parts \\[1\\] are not where this pass starts"):
        engine.begin_pass(und_only, prefetch=(1,))  # a second fetch of the part already in its slot
    start = len(fake.log)
    assert run_pass(engine, fake, GEN_PASS).fetches == LAYERS
    assert [e[2] for e in fake.log[start:] if e[0] == "copy"].count(1) == 1  # the next pass's, not its own
    (tmp_path / "fresh").mkdir()
    fresh, fake = make_engine(tmp_path / "fresh", monkeypatch)
    for _ in range(2):  # a job of reasoners alone: no GEN part is ever fetched
        run_pass(fresh, fake, und_only, prefetch=())
    assert all(e[2] % 2 == 0 for e in fake.log if e[0] == "copy")


def test_the_gathers_are_issued_in_an_order_set_by_the_calls_alone(tmp_path, monkeypatch):
    # Collectives must be issued in the same order on every rank, however fast each rank's device is:
    # the engine never decides anything from an event's state.
    orders = []
    for name, now in (("fast", math.inf), ("slow", 0.0)):
        (tmp_path / name).mkdir()
        engine, fake = make_engine(tmp_path / name, monkeypatch)
        fake.device_now = now
        for order in (UND_PASS, GEN_PASS, UND_PASS):
            run_pass(engine, fake, order)
        orders.append([e[2] for e in fake.log if e[0] == "gather"])
    assert orders[0] == orders[1]
    # U0 G0 G1, then U1 once U0 has computed: G1 goes ahead of U1, into the second GEN slot.
    assert orders[0][:5] == [0, 1, 3, 2, 5]


def test_collect_reads_what_completed_after_the_last_pass(tmp_path, monkeypatch):
    engine, fake = make_engine(tmp_path, monkeypatch)
    fake.device_now = 0.0
    assert run_pass(engine, fake, GEN_PASS).compute_s == 0.0  # not complete at its end_pass
    fake.device_now = math.inf  # e.g. a benchmark synchronized the device
    assert engine.collect().compute_s * 1000 == pytest.approx(LAYERS * COMPUTE_MS["gen"], rel=1e-12)
    assert engine.collect().compute_s == 0.0  # read once


def test_drain_waits_for_the_last_passes_events_and_reads_them_once(tmp_path, monkeypatch):
    # The runner's end: without it a short run's last passes (most of its times) never reach the totals.
    engine, fake = make_engine(tmp_path, monkeypatch)
    fake.device_now = 0.0  # the device is behind: no pass has completed at its end_pass
    first, second = run_pass(engine, fake, UND_PASS), run_pass(engine, fake, GEN_PASS)
    assert first.compute_s == second.compute_s == 0.0
    waits = []

    def device_catches_up(seconds):  # the host waits; meanwhile the device runs what was issued
        waits.append(seconds)
        fake.device_now = math.inf

    monkeypatch.setattr(cuda_backend.time, "sleep", device_catches_up)
    drained = engine.drain()
    both = LAYERS * (COMPUTE_MS["und"] + COMPUTE_MS["gen"]) + LAYERS * COMPUTE_MS["gen"]
    assert drained.compute_s * 1000 == pytest.approx(both, rel=1e-12) and waits
    assert not [e for e in fake.log if e[0] == "host_wait"]  # polled events, no device-wide synchronize
    assert engine.drain().compute_s == 0.0  # read once


def test_drain_gives_up_at_its_deadline_when_a_pass_never_completes(tmp_path, monkeypatch, caplog):
    engine, fake = make_engine(tmp_path, monkeypatch)
    fake.device_now = 0.0  # a gather stuck on a dead peer: its pass never completes
    run_pass(engine, fake, GEN_PASS)
    engine.config = dataclasses.replace(engine.config, close_timeout_s=0.05)
    with caplog.at_level("WARNING", logger="cosmos3_batch"):
        assert engine.drain().compute_s == 0.0
    assert "device times of the last passes not read" in caplog.text
