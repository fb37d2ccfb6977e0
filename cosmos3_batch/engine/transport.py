"""Device slots filled ahead of compute (copy own shard + AllGather in place), as slots.py schedules.

What a fetch does is the same on every backend (`fill_slot`); *where* it runs differs:

* CPU (tests, this machine): one background worker thread runs fetches in submission order. Gathers
  go to their own gloo group, so they never interleave with the main group's per-pass all-reduce.
  Times are wall clock, measured on the compute thread (stall, compute) and the worker (collective).
* CUDA (`cuda_backend.py`): the copy runs on a copy stream, the gather on a comm stream, and compute
  waits on the part's event. Nothing blocks the host; nothing synchronizes the device. Times come from
  CUDA events, read once per pass.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, fields
from enum import StrEnum

import torch
import torch.distributed as dist

from cosmos3_batch.engine.host import FileReader, HostShards, LocalPiece
from cosmos3_batch.engine.layout import PartLayout

log = logging.getLogger(__name__)


class OffloadMode(StrEnum):
    ALLGATHER = "allgather"  # host keeps 1/N of each part; H2D own shard + AllGather per part (default)
    LOCAL = "local"  # no AllGather: every rank streams whole parts from the node-shared mmap
    RESIDENT = "resident"  # all weights on the device: the baseline
    SHARDED = "sharded"  # shards live on the device, gathered per part: the HSDP-style baseline


@dataclass
class Counters:
    """Per rank, per pass (`LayerOffload.end_pass` returns them and starts the next pass from zero).

    Bytes and fetches count the parts the pass consumed. On CUDA the times are device times from event
    pairs (the compute stream's idle wait for a part, the comm stream's gathers, the copy stream's H2D,
    the compute stream between waits), read without a sync once their pass's events have completed: a
    pass's times may arrive with a later pass's counters, never lost, never twice.
    """

    h2d_bytes: int = 0  # host -> device (on CPU: host arena/mmap -> slot)
    gathered_bytes: int = 0  # received from other ranks by AllGather (part bytes minus own shard)
    stall_s: float = 0.0  # compute waited for a part to arrive
    collective_s: float = 0.0  # inside gathers (CPU: the worker's calls; CUDA: comm-stream time)
    compute_s: float = 0.0  # computing layer parts (from the end of one wait to the start of the next)
    h2d_s: float = 0.0  # host -> device copies (CUDA: copy-stream time; CPU: worker wall clock)
    fetches: int = 0

    def take(self) -> Counters:
        snapshot = Counters(**vars(self))
        for f in fields(self):
            setattr(self, f.name, type(getattr(self, f.name))())
        return snapshot

    def add(self, other: Counters) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def stall_share(self) -> float:
        """Share of the layer walk that compute spent waiting for weights (0 when nothing was timed)."""
        busy = self.stall_s + self.compute_s
        return self.stall_s / busy if busy > 0 else 0.0


@dataclass
class FetchSource:
    """Where a part's bytes come from, per mode."""

    mode: OffloadMode
    layouts: list[PartLayout]
    rank: int
    world_size: int
    group: object | None = None  # process group for gathers
    host: HostShards | None = None  # allgather / sharded
    local: list[list[LocalPiece]] = field(default_factory=list)  # local: each part's pieces
    reader: FileReader | None = None  # local: host reads with pread (never loads from the mapping)
    # allgather where ranks share one GPU (`--device cuda:N`): the group is gloo, which cannot gather CUDA
    # tensors, so the part is gathered in host memory (`host_gather`) and crosses to the device whole.
    staged: bool = False


def fetch_bytes(src: FetchSource, index: int) -> tuple[int, int]:
    """(host -> device bytes, bytes received by AllGather) of one fetch of part `index` on this rank."""
    layout = src.layouts[index]
    if src.mode is OffloadMode.LOCAL:
        return layout.payload_bytes, 0
    gathered = layout.nbytes - layout.shard_bytes if src.world_size > 1 else 0
    if src.staged:
        return layout.nbytes, gathered
    return (layout.shard_bytes if src.mode is OffloadMode.ALLGATHER else 0), gathered


def copy_in(src: FetchSource, index: int, slot: torch.Tensor, non_blocking: bool = False) -> None:
    """Host -> slot: our own shard into our own range (allgather), or the whole part (local)."""
    layout = src.layouts[index]
    buf = slot[: layout.nbytes]
    if src.mode is OffloadMode.LOCAL:
        for piece in src.local[index]:
            dst = buf[piece.offset : piece.offset + piece.data.numel()]
            if dst.device.type == "cpu":
                src.reader.read(piece, dst)
            else:  # CUDA with the maps registered: DMA out of the page cache, no host read at all
                dst.copy_(piece.data, non_blocking=non_blocking)
    elif src.mode is OffloadMode.ALLGATHER:
        lo, hi = layout.shard_range(src.rank)
        buf[lo:hi].copy_(src.host.shard(index), non_blocking=non_blocking)
    elif src.world_size == 1:  # sharded, alone: the "gather" is a device-local copy
        buf.copy_(src.host.shard(index), non_blocking=non_blocking)


class CollectiveFailed(RuntimeError):
    """A collective call of ours raised (gloo and NCCL raise a plain RuntimeError or a DistError): a peer
    stalled or died, told apart by how long the call waited (parallel/stall.py), never by its words.
    Errors that are not a collective's (a failed read, a shape mismatch in our compute) never become one."""

    def __init__(self, what: str, cause: BaseException, waited_s: float):
        super().__init__(f"{what}: {type(cause).__name__}: {cause}")
        self.what, self.waited_s = what, waited_s


# Raised inside a collective call but this rank's own: a device allocation of the call (all_gather_object on
# NCCL moves the pickled objects to the device), an earlier kernel's fault surfacing at the enqueue.
OWN_ERRORS = (
    torch.OutOfMemoryError,
    *((torch.AcceleratorError,) if hasattr(torch, "AcceleratorError") else ()),
)


@contextlib.contextmanager
def collective_call(what: str) -> Iterator[None]:
    """Around one call into torch.distributed: what it raises becomes CollectiveFailed, with the seconds it
    waited (a stalled peer makes it wait out the group's timeout; a dead one's closed connection does not)."""
    start = time.monotonic()
    try:
        yield
    except OWN_ERRORS:  # this rank's device (out of memory, an earlier kernel's fault): its own crash
        raise
    except CollectiveFailed:
        raise
    except RuntimeError as exc:
        raise CollectiveFailed(what, exc, time.monotonic() - start) from exc


def _all_gather_op():
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns FutureWarning on
    # every call, so once per rank per part); torch 2.11 (the GPU image) has only the old name.
    single = getattr(dist, "all_gather_single", None)
    return single if single is not None else dist.all_gather_into_tensor


ALL_GATHER = _all_gather_op()


def gathers(src: FetchSource) -> bool:
    return src.mode is not OffloadMode.LOCAL and src.world_size > 1


def gather(src: FetchSource, index: int, slot: torch.Tensor) -> None:
    """Rebuild the part on every rank: one AllGather, in place for allgather (input = own slice)."""
    if not gathers(src):
        return
    layout = src.layouts[index]
    buf = slot[: layout.nbytes]
    lo, hi = layout.shard_range(src.rank)
    shard = buf[lo:hi] if src.mode is OffloadMode.ALLGATHER else src.host.shard(index)
    with collective_call(f"the gather of part {index}"):
        ALL_GATHER(buf, shard, group=src.group)


def host_gather(src: FetchSource, index: int, out: torch.Tensor) -> None:
    """A staged fetch's gather: every rank's host shard into `out` (host memory), one gloo AllGather."""
    layout = src.layouts[index]
    with collective_call(f"the gather of part {index}"):
        ALL_GATHER(out[: layout.nbytes], src.host.shard(index), group=src.group)


def fill_slot(src: FetchSource, index: int, slot: torch.Tensor) -> tuple[float, float]:
    """Make the slot hold part `index` on this rank; issues the same collective on every rank.
    Returns wall-clock seconds (copy, gather)."""
    start = time.perf_counter()
    copy_in(src, index, slot)
    copied = time.perf_counter()
    if not gathers(src):
        return copied - start, 0.0
    gather(src, index, slot)
    return copied - start, time.perf_counter() - copied


class CpuBackend:
    """Fetches on one worker thread, in order: the CPU stand-in for the copy and comm streams."""

    def __init__(self, source: FetchSource, slots: list[torch.Tensor]):
        self.source = source
        self.slots = slots
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dlo-fetch")
        self._times = Counters()  # this pass's times, touched only by the compute thread
        self._compute_from: float | None = None
        self._inflight: list[Future] = []

    def submit(self, index: int, slot: int) -> Future:
        # The slot is free: the part that last used it finished computing before it was released (CPU
        # compute is synchronous on the main thread), so the worker may overwrite it.
        future = self._worker.submit(fill_slot, self.source, index, self.slots[slot])
        self._inflight = [f for f in self._inflight if not f.done()] + [future]
        return future

    def wait(self, handle: Future, slot: int) -> None:
        start = time.perf_counter()
        if self._compute_from is not None:
            self._times.compute_s += start - self._compute_from
        copy_s, gather_s = handle.result()  # re-raises a failed gather here, on the compute thread
        self._compute_from = time.perf_counter()
        self._times.stall_s += self._compute_from - start
        self._times.h2d_s += copy_s
        self._times.collective_s += gather_s

    def release(self, slot: int) -> None:
        pass  # compute on CPU is finished when the main thread moves on

    def end_pass(self, counters: Counters) -> None:
        if self._compute_from is not None:
            self._times.compute_s += time.perf_counter() - self._compute_from
            self._compute_from = None
        counters.add(self._times.take())

    def drain(self, counters: Counters, timeout_s: float) -> bool:
        """The CPU's times are host clocks, read at each end_pass: nothing is ever left to read."""
        return True

    def close(self, timeout_s: float) -> bool:
        """True once every fetch has finished; False if one is stuck (a dead peer): not joined then."""
        _, stuck = wait(self._inflight, timeout=timeout_s)
        if stuck:
            # A gather whose peer died: its thread cannot be interrupted; do not join it (the process is
            # exiting with an error anyway).
            log.warning(
                "%d fetch(es) still in flight after %.0f s: not waiting for them", len(stuck), timeout_s
            )
            self._worker.shutdown(wait=False, cancel_futures=True)
            return False
        self._worker.shutdown(wait=True)
        return True


def parse_offload(name: str) -> OffloadMode:
    try:
        return OffloadMode(name)
    except ValueError:
        modes = ", ".join(m.value for m in OffloadMode)
        raise ValueError(f"--offload must be one of {modes}, got {name!r}") from None
