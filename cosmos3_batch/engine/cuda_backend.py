"""The CUDA-only part of the transport: streams, events and pinned host memory. Kept this small on
purpose: layout, ordering and bookkeeping are shared with the CPU backend and tested there; the
ordering below is tested on CPU with stand-in streams/events (tests/unit/test_cuda_ordering.py).

Per fetch of part k into slot s:
    copy stream:  wait slot_free[s] -> H2D own shard (pinned, non_blocking) -> record copied[s]
    comm stream:  wait copied[s]    -> AllGather in place (NCCL)              -> record ready[s]
    compute:      wait ready[s] (in `wait`), run the part, record slot_free[s] (in `release`)
No host blocking and no device-wide synchronize in the steady state: only stream-event edges.

Two paths go through a host thread and a pinned staging buffer per slot instead: `local` mode when the
mapped files cannot be registered (the thread preads the part), and a staged AllGather when ranks share
one GPU (`--device cuda:N`: the group is gloo, which has no in-place gather of CUDA tensors, so the thread
gathers the part in host memory). The thread then issues the whole part's H2D on the copy stream.

Timing: each of those steps is bracketed by a pair of timing events (copy and gather on their streams;
on the compute stream one pair around the wait for ready[s], whose gap is the stall, and the gap from one
wait's end to the next wait's start, which is compute). A pass's pairs are read at the end of a later pass
once its last event has completed (`query()`, which does not block), so reading never syncs the device.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from cosmos3_batch.engine.pinning import PinnedRegion, register_read_only
from cosmos3_batch.engine.transport import (
    Counters,
    FetchSource,
    OffloadMode,
    copy_in,
    gather,
    gathers,
    host_gather,
)

log = logging.getLogger(__name__)
KIND_FIELD = {"stall": "stall_s", "compute": "compute_s", "gather": "collective_s", "copy": "h2d_s"}
STAGING_THREADS = 8  # host threads filling a staging buffer when the mapped file cannot be registered
STAGING_CHUNK = 16 << 20  # bytes one staging thread copies at a time
HIGH_PRIORITY = -1  # CUDA stream priority: lower is higher; out-of-range values are clamped to the range


@dataclass
class Span:
    kind: str  # a key of KIND_FIELD
    start: object  # timing events (torch.cuda.Event(enable_timing=True), or stand-ins)
    end: object


class _HostMark:
    """A host clock reading that reads like a timing event: a staged gather runs on a host thread."""

    def __init__(self) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _HostMark) -> float:
        return (end.t - self.t) * 1000.0


class _Issued:
    """Handle of a fetch issued from this thread: nothing left for the host to wait for."""

    def __init__(self, spans: list[Span]):
        self.spans = spans

    def result(self) -> list[Span]:
        return self.spans


class CudaBackend:
    def __init__(self, source: FetchSource, slots: list[torch.Tensor], device, cuda=None, cudart=None):
        self.cuda = cuda if cuda is not None else torch.cuda  # stand-ins in the CPU ordering test
        self.source = source
        self.slots = slots
        self.compute = self.cuda.current_stream(device)
        # High priority: a part's copy and gather are on compute's critical path (compute waits for them),
        # so when the device is busy, their kernels are scheduled ahead of the decode on the side stream.
        self.copy_stream = self.cuda.Stream(device, priority=HIGH_PRIORITY)
        self.comm_stream = self.cuda.Stream(device, priority=HIGH_PRIORITY)
        self.slot_free = [self.cuda.Event() for _ in slots]
        self.copied = [self.cuda.Event() for _ in slots]
        self.ready = [self.cuda.Event() for _ in slots]
        self._staged = [self.cuda.Event() for _ in slots]
        self._pool: list = []  # timing events whose values have been read: reused, never re-created
        self._pass: list[Span] = []  # spans of the pass being computed
        self._ended: deque[tuple[object, list[Span]]] = deque()  # (last event, spans) not yet read
        self._compute_from = None  # timing event: the compute stream left its last wait
        self._pinned: list[PinnedRegion] = []
        self._staging: list[torch.Tensor] = []
        self._worker = None
        self._copiers = None
        self._staging_jobs: list = []
        real = cuda is None
        if source.mode is OffloadMode.ALLGATHER and not source.staged and (real or cudart is not None):
            self._pinned.append(PinnedRegion.of_tensor(source.host.arena, cudart))
        self.registered = False
        if source.mode is OffloadMode.LOCAL:
            self._setup_local(device, real, cudart)
        elif source.staged:
            self._setup_staging(device, real, cudart)

    def _setup_local(self, device, real: bool, cudart) -> None:
        # Where the driver allows it, DMA straight out of the page cache: register the mapped layer bytes
        # read-only (page-aligned spans, one per file). Else a host thread stages each part into pinned
        # buffers, copying with several threads (one memcpy thread reaches ~10 GB/s, far below H2D).
        by_file: dict[int, list[torch.Tensor]] = {}
        for pieces in self.source.local:
            for piece in pieces:
                by_file.setdefault(piece.data.untyped_storage().data_ptr(), []).append(piece.data)
        index = device.index if isinstance(device, torch.device) and device.index is not None else 0
        regions = (
            register_read_only(list(by_file.values()), cudart, index)
            if (real or cudart is not None)
            else None
        )
        if regions is not None:
            self._pinned += regions
            self.registered = True
            return
        log.info("local mode: the mapped checkpoint cannot be registered; staging through pinned buffers")
        self._setup_staging(device, real, cudart)
        self._copiers = ThreadPoolExecutor(max_workers=STAGING_THREADS, thread_name_prefix="dlo-memcpy")

    def _setup_staging(self, device, real: bool, cudart) -> None:
        self._staging = [torch.empty(slot.numel(), dtype=torch.uint8) for slot in self.slots]
        if real or cudart is not None:
            self._pinned += [PinnedRegion.of_tensor(buf, cudart) for buf in self._staging]
        # The thread must drive this rank's GPU: a new thread starts on device 0, where it would create
        # a context (and memory) on another rank's GPU.
        init = (lambda: torch.cuda.set_device(device)) if real else (lambda: None)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dlo-stage", initializer=init)

    def _timed(self):
        # Also called from the staging thread: list.pop is atomic, a check-then-pop would not be.
        try:
            return self._pool.pop()
        except IndexError:
            return self.cuda.Event(enable_timing=True)

    def _mark(self, stream):
        event = self._timed()
        event.record(stream)
        return event

    def release(self, slot: int) -> None:
        # Everything that reads this slot has been issued on the compute stream by now.
        self.slot_free[slot].record(self.compute)

    def submit(self, index: int, slot: int):
        if self._worker is not None:  # staging: one host thread, fetches in submission order
            future = self._worker.submit(self._stage_and_copy, index, slot)
            self._staging_jobs = [f for f in self._staging_jobs if not f.done()] + [future]
            return future
        spans = []
        with self.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.slot_free[slot])  # the slot's last reader has run
            start = self._mark(self.copy_stream)
            copy_in(self.source, index, self.slots[slot], non_blocking=True)
            spans.append(Span("copy", start, self._mark(self.copy_stream)))
            self.copied[slot].record(self.copy_stream)
        if self.source.mode is OffloadMode.LOCAL:
            self.ready[slot].record(self.copy_stream)  # registered local mode: no gather
            return _Issued(spans)
        with self.cuda.stream(self.comm_stream):
            self.comm_stream.wait_event(self.copied[slot])  # gather only what has fully landed
            if gathers(self.source):
                start = self._mark(self.comm_stream)
                gather(self.source, index, self.slots[slot])
                spans.append(Span("gather", start, self._mark(self.comm_stream)))
            self.ready[slot].record(self.comm_stream)
        return _Issued(spans)

    def _stage_and_copy(self, index: int, slot: int) -> list[Span]:
        layout = self.source.layouts[index]
        staging = self._staging[slot]
        # The previous H2D out of this staging buffer must be done before the host overwrites it: an
        # event wait on the host (one stream's progress), never a device-wide synchronize.
        self._staged[slot].synchronize()
        spans = self._fill(index, staging)
        with self.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.slot_free[slot])
            start = self._mark(self.copy_stream)
            self.slots[slot][: layout.nbytes].copy_(staging[: layout.nbytes], non_blocking=True)
            spans.append(Span("copy", start, self._mark(self.copy_stream)))
            self._staged[slot].record(self.copy_stream)
            self.ready[slot].record(self.copy_stream)
        return spans

    def _fill(self, index: int, staging: torch.Tensor) -> list[Span]:
        """Put part `index` into the staging buffer, on the staging thread."""
        if self.source.staged:
            # Gathers run on this one thread in submission order, so every rank issues them in one order.
            start = _HostMark()
            host_gather(self.source, index, staging)
            return [Span("gather", start, _HostMark())]
        # pread, not copies out of the mapping: a truncated file reads short instead of SIGBUS (FileReader).
        jobs = [
            self._copiers.submit(
                self.source.reader.read, piece, staging[piece.offset + lo : piece.offset + hi], lo
            )
            for piece in self.source.local[index]
            for lo, hi in _chunks(piece.data.numel())
        ]
        for job in jobs:
            job.result()
        return []

    def wait(self, handle, slot: int) -> None:
        spans = handle.result()  # local staging: the thread has issued its copy; else already issued
        start = self._mark(self.compute)
        if self._compute_from is not None:
            self._pass.append(Span("compute", self._compute_from, start))
        self.compute.wait_event(self.ready[slot])  # device-side edge: the host does not block
        self._compute_from = self._mark(self.compute)
        self._pass += [Span("stall", start, self._compute_from), *spans]

    def end_pass(self, counters: Counters) -> None:
        """Close this pass's spans and add the times of every ended pass whose events have completed."""
        end = self._mark(self.compute)
        if self._compute_from is not None:
            self._pass.append(Span("compute", self._compute_from, end))
        self._ended.append((end, self._pass))
        self._pass, self._compute_from = [], None
        # The pass's last compute event completes after all of its other events: the compute stream
        # waited for each part's ready event, recorded after that part's copy and gather. So one
        # non-blocking query says all of its pairs can be read.
        while self._ended and self._ended[0][0].query():
            _, spans = self._ended.popleft()
            self._read(spans, counters)

    def drain(self, counters: Counters, timeout_s: float) -> bool:
        """After the last pass (teardown, not the steady state): wait, with a deadline and without a device
        synchronize, for every ended pass's events, and add their times: the last passes' are otherwise
        never read. False if some never completed (a gather stuck on a dead peer): those stay unread."""
        deadline = time.monotonic() + timeout_s
        while self._ended:
            end, spans = self._ended[0]
            if end.query():
                self._ended.popleft()
                self._read(spans, counters)
            elif time.monotonic() > deadline:
                return False
            else:
                time.sleep(0.001)
        return True

    def _read(self, spans: list[Span], counters: Counters) -> None:
        seen: dict[int, object] = {}
        for span in spans:
            field = KIND_FIELD[span.kind]
            seconds = span.start.elapsed_time(span.end) / 1000.0  # milliseconds between the two records
            setattr(counters, field, getattr(counters, field) + seconds)
            seen[id(span.start)], seen[id(span.end)] = span.start, span.end
        self._pool.extend(e for e in seen.values() if not isinstance(e, _HostMark))  # CUDA events only

    def close(self, timeout_s: float) -> bool:
        """Teardown, not the steady state: wait (with a deadline) for what the streams still hold, since
        DMA out of a registered range may be in flight after an error mid-pass and unregistering under it
        would be undefined. A gather stuck on a dead peer never completes: then leave the memory
        registered (the process is exiting) rather than hang."""
        deadline = time.monotonic() + timeout_s
        if self._worker is not None:
            # Staging jobs issue copies: let them finish first, so the fences below come after them.
            _, stuck = wait(self._staging_jobs, timeout=timeout_s)
            self._worker.shutdown(wait=False, cancel_futures=True)
            if self._copiers is not None:
                self._copiers.shutdown(wait=False, cancel_futures=True)
            if stuck:
                log.warning("a staging copy is still running %.0f s after the end: not waiting", timeout_s)
                return False
        fences = []
        for stream in (self.copy_stream, self.comm_stream, self.compute):
            fence = self.cuda.Event()
            fence.record(stream)
            fences.append(fence)
        while not all(f.query() for f in fences):
            if time.monotonic() > deadline:
                log.warning(
                    "streams still busy %.0f s after the end (a stuck gather?): not waiting", timeout_s
                )
                return False
            time.sleep(0.01)
        for region in self._pinned:
            region.close()
        self._pinned = []
        return True


def _chunks(nbytes: int) -> list[tuple[int, int]]:
    """Byte ranges of at most STAGING_CHUNK bytes: the unit one staging thread copies."""
    return [(lo, min(lo + STAGING_CHUNK, nbytes)) for lo in range(0, nbytes, STAGING_CHUNK)]
