"""The CUDA backend's stream/event ordering, exercised on CPU with stand-in streams and events.

What must hold for every fetch of part k into slot s (see cuda_backend.py):
  copy stream waits slot_free[s] before writing the slot; the gather runs on the comm stream after it
  waited copied[s]; ready[s] is recorded after the gather; compute waits ready[s] before using the part;
  slot_free[s] is recorded on the compute stream before the slot is refilled. No host-side waits.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from cosmos3_batch.engine import cuda_backend
from cosmos3_batch.engine.layout import ParamSpec, build_part_layout
from cosmos3_batch.engine.transport import Counters, FetchSource, OffloadMode


class FakeCuda:
    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.current = None
        self._events = 0
        self._streams = iter(["copy", "comm"])

    class _Stream:
        def __init__(self, owner, name):
            self.owner, self.name = owner, name

        def wait_event(self, event):
            self.owner.log.append(("wait", self.name, event.name))

    class _Event:
        def __init__(self, owner, name):
            self.owner, self.name = owner, name

        def record(self, stream):
            self.owner.log.append(("record", stream.name, self.name))

        def synchronize(self):
            self.owner.log.append(("host_wait", self.name))

    def current_stream(self, device):
        self.compute = self._Stream(self, "compute")
        self.current = self.compute
        return self.compute

    def Stream(self, device):
        return self._Stream(self, next(self._streams))

    def Event(self):
        # Created in the backend's order: slot_free[0..1], copied[0..1], ready[0..1], staged[0..1].
        names = ["slot_free0", "slot_free1", "copied0", "copied1", "ready0", "ready1", "staged0", "staged1"]
        event = self._Event(self, names[self._events])
        self._events += 1
        return event

    @contextmanager
    def stream(self, stream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous


def make_backend(monkeypatch, world_size: int = 2):
    fake = FakeCuda()
    layouts = [
        build_part_layout(f"p{i}", [ParamSpec(f"w{i}", torch.float32, (8,))], world_size) for i in range(3)
    ]
    source = FetchSource(OffloadMode.ALLGATHER, layouts, rank=0, world_size=world_size)
    monkeypatch.setattr(
        cuda_backend,
        "copy_in",
        lambda src, i, slot, c, non_blocking: fake.log.append(("copy", fake.current.name, i, non_blocking)),
    )
    monkeypatch.setattr(
        cuda_backend, "gather", lambda src, i, slot, c: fake.log.append(("gather", fake.current.name, i))
    )
    slots = [torch.empty(layouts[0].nbytes, dtype=torch.uint8) for _ in range(2)]
    backend = cuda_backend.CudaBackend(source, slots, Counters(), "cpu", cuda=fake)
    return backend, fake


def drive(backend, order):
    """The call sequence LayerOffload issues: (release, submit) ahead, then wait, compute, next."""
    next_slot, pending = 0, {}

    def submit(index):
        nonlocal next_slot
        slot, next_slot = next_slot, next_slot ^ 1
        backend.release(slot)
        pending[index] = (slot, backend.submit(index, slot))

    submit(order[0])
    for pos, index in enumerate(order):
        slot, handle = pending.pop(index)
        backend.wait(handle, slot)
        if pos + 1 < len(order):
            submit(order[pos + 1])
        backend.cuda.log.append(("compute", f"part{index}", f"slot{slot}"))


def test_fetch_ordering_on_streams(monkeypatch):
    backend, fake = make_backend(monkeypatch)
    drive(backend, [0, 1, 2])
    log = fake.log
    assert ("host_wait",) not in {entry[:1] for entry in log}  # nothing blocks the host
    # Part 2 reuses slot 0: its copy waits on slot_free0 recorded *after* part 0's compute was issued.
    compute0 = log.index(("compute", "part0", "slot0"))
    free0 = max(i for i, e in enumerate(log) if e == ("record", "compute", "slot_free0"))
    wait_free0 = max(i for i, e in enumerate(log) if e == ("wait", "copy", "slot_free0"))
    copy2 = log.index(("copy", "copy", 2, True))
    assert compute0 < free0 < wait_free0 < copy2
    for part, slot in ((0, 0), (1, 1), (2, 0)):
        copy = log.index(("copy", "copy", part, True))
        copied = next(i for i, e in enumerate(log) if i > copy and e == ("record", "copy", f"copied{slot}"))
        waited = next(i for i, e in enumerate(log) if i > copied and e == ("wait", "comm", f"copied{slot}"))
        gathered = log.index(("gather", "comm", part))
        ready = next(i for i, e in enumerate(log) if i > gathered and e == ("record", "comm", f"ready{slot}"))
        used = next(i for i, e in enumerate(log) if i > ready and e == ("wait", "compute", f"ready{slot}"))
        assert (
            copy
            < copied
            < waited
            < gathered
            < ready
            < used
            < log.index(("compute", f"part{part}", f"slot{slot}"))
        )


def test_prefetch_is_issued_before_current_part_computes(monkeypatch):
    backend, fake = make_backend(monkeypatch)
    drive(backend, [0, 1, 2])
    # Overlap: the fetch of part k+1 is on its streams before part k's compute is issued.
    for part in (0, 1):
        assert fake.log.index(("gather", "comm", part + 1)) < fake.log.index(
            ("compute", f"part{part}", f"slot{part % 2}")
        )
