"""Two device slots; part k+1 is fetched (copy own shard + AllGather in place) while part k computes.

What a fetch does is the same on every backend (`fill_slot`); *where* it runs differs:

* CPU (tests, this machine): one background worker thread runs fetches in submission order. Gathers
  go to their own gloo group, so they never interleave with the main group's per-pass all-reduce.
* CUDA (`cuda_backend.py`): the copy runs on a copy stream, the gather on a comm stream, and compute
  waits on the part's event. Nothing blocks the host; nothing synchronizes the device.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum

import torch
import torch.distributed as dist

from cosmos3_batch.engine.host import HostShards
from cosmos3_batch.engine.layout import PartLayout


class OffloadMode(StrEnum):
    ALLGATHER = "allgather"  # host keeps 1/N of each part; H2D own shard + AllGather per part (default)
    LOCAL = "local"  # no AllGather: every rank streams whole parts from the node-shared mmap
    RESIDENT = "resident"  # all weights on the device: the baseline
    SHARDED = "sharded"  # shards live on the device, gathered per part: the HSDP-style baseline


@dataclass
class Counters:
    """Per rank, reset every pass by the runner."""

    h2d_bytes: int = 0  # host -> device (on CPU: host arena/mmap -> slot)
    gathered_bytes: int = 0  # received from other ranks by AllGather (part bytes minus own shard)
    stall_s: float = 0.0  # compute waited for a part to arrive
    collective_s: float = 0.0  # inside gather calls (worker thread / comm stream issue)
    fetches: int = 0

    def take(self) -> Counters:
        snapshot = Counters(**vars(self))
        self.h2d_bytes = self.gathered_bytes = self.fetches = 0
        self.stall_s = self.collective_s = 0.0
        return snapshot


@dataclass
class FetchSource:
    """Where a part's bytes come from, per mode."""

    mode: OffloadMode
    layouts: list[PartLayout]
    rank: int
    world_size: int
    group: object | None = None  # process group for gathers
    host: HostShards | None = None  # allgather / sharded
    local: list[list[tuple[torch.Tensor, int]]] = field(default_factory=list)  # local: (mmap bytes, offset)


def copy_in(
    src: FetchSource, index: int, slot: torch.Tensor, counters: Counters, non_blocking: bool = False
) -> None:
    """Host -> slot: our own shard into our own range (allgather), or the whole part (local)."""
    layout = src.layouts[index]
    buf = slot[: layout.nbytes]
    if src.mode is OffloadMode.LOCAL:
        for data, offset in src.local[index]:
            buf[offset : offset + data.numel()].copy_(data, non_blocking=non_blocking)
        counters.h2d_bytes += layout.payload_bytes
    elif src.mode is OffloadMode.ALLGATHER:
        lo, hi = layout.shard_range(src.rank)
        buf[lo:hi].copy_(src.host.shard(index), non_blocking=non_blocking)
        counters.h2d_bytes += layout.shard_bytes
    elif src.world_size == 1:  # sharded, alone: the "gather" is a device-local copy
        buf.copy_(src.host.shard(index), non_blocking=non_blocking)


def gather(src: FetchSource, index: int, slot: torch.Tensor, counters: Counters) -> None:
    """Rebuild the part on every rank: one AllGather, in place for allgather (input = own slice)."""
    if src.mode is OffloadMode.LOCAL or src.world_size == 1:
        return
    layout = src.layouts[index]
    buf = slot[: layout.nbytes]
    lo, hi = layout.shard_range(src.rank)
    shard = buf[lo:hi] if src.mode is OffloadMode.ALLGATHER else src.host.shard(index)
    start = time.perf_counter()
    dist.all_gather_into_tensor(buf, shard, group=src.group)
    counters.collective_s += time.perf_counter() - start
    counters.gathered_bytes += layout.nbytes - layout.shard_bytes


def fill_slot(src: FetchSource, index: int, slot: torch.Tensor, counters: Counters) -> None:
    """Make the slot hold part `index` on this rank. Issues the same collective on every rank."""
    copy_in(src, index, slot, counters)
    gather(src, index, slot, counters)
    counters.fetches += 1


class CpuBackend:
    """Fetches on one worker thread, in order: the CPU stand-in for the copy and comm streams."""

    def __init__(self, source: FetchSource, slots: list[torch.Tensor], counters: Counters):
        self.source = source
        self.slots = slots
        self.counters = counters
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dlo-fetch")

    def submit(self, index: int, slot: int) -> Future:
        # The slot is free: the part that last used it finished computing before this call (CPU compute
        # is synchronous on the main thread), so the worker may overwrite it.
        return self._worker.submit(fill_slot, self.source, index, self.slots[slot], self.counters)

    def wait(self, handle: Future, slot: int) -> None:
        handle.result()  # re-raises a failed gather here, on the compute thread

    def release(self, slot: int) -> None:
        pass  # compute on CPU is finished when the main thread moves on

    def close(self) -> None:
        self._worker.shutdown(wait=True)
