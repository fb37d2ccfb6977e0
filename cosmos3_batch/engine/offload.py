"""The DLO engine's face: an ordered list of layer parts, fetched ahead into per-lane device slots.

Model-agnostic: a part is a key, a lane and the (module, parameter name, checkpoint name) triples it owns.
Usage per pass: `begin_pass(order, prefetch)` with the part indices the pass will compute (and the parts
the *next* pass is known to start with), then `acquire(i)` for each in that order: it waits for part i,
re-points its parameters at the slot, frees the slot of the part before it and issues every fetch that
now has a free slot (slots.py decides which), so transfers overlap compute. `end_pass()` returns the
pass's counters: bytes and fetches counted on this thread when parts are consumed (exact, whatever is in
flight), times from the backend (wall clock on CPU, CUDA events on the GPU).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cosmos3_batch.checkpoint.reader import CheckpointFileError, TensorStore
from cosmos3_batch.engine.host import FileReader, HostShards, local_sources
from cosmos3_batch.engine.layout import ALIGN, ParamSpec, PartLayout, build_part_layout, layout_digest
from cosmos3_batch.engine.slots import SlotScheduler
from cosmos3_batch.engine.transport import (
    Counters,
    CpuBackend,
    FetchSource,
    OffloadMode,
    collective_call,
    fetch_bytes,
)

log = logging.getLogger("cosmos3_batch")


@dataclass(frozen=True)
class PartBinding:
    key: str
    params: tuple[tuple[torch.nn.Module, str, str], ...]  # (owning module, leaf name, checkpoint name)
    lane: str = "main"  # parts of one lane share that lane's slots (see slots.py)


@dataclass(frozen=True)
class OffloadConfig:
    mode: OffloadMode = OffloadMode.ALLGATHER
    rank: int = 0
    world_size: int = 1
    align: int = ALIGN
    lane_slots: tuple[tuple[str, int], ...] = ()  # (lane, slots); a lane not named gets two
    # close() waits this long for fetches in flight, never forever. Short: a normal end has at most the next
    # pass's prefetch in flight (issued on every rank, so it completes); after a peer died, the survivor
    # must exit within --collective-timeout-s + 30 s.
    close_timeout_s: float = 10.0
    # The dtype each parameter computes in, from its checkpoint name and stored dtype (None: as stored). The
    # host shards are cast while they are read, so every fetch moves the compute dtype's bytes.
    cast: Callable[[str, torch.dtype], torch.dtype] | None = None

    def __post_init__(self) -> None:
        if self.mode is OffloadMode.RESIDENT:
            raise ValueError("resident mode needs no offload engine")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of {self.world_size}")

    def dtype_of(self, name: str, stored: torch.dtype) -> torch.dtype:
        return stored if self.cast is None else self.cast(name, stored)


class LayoutMismatch(RuntimeError):
    """Ranks would move different bytes: raised on every rank instead of a hang in the first gather."""


class LayerOffload:
    def __init__(
        self,
        bindings: list[PartBinding],
        store: TensorStore,
        config: OffloadConfig,
        device: torch.device,
        group=None,
    ):
        self.config = config
        self.device = device
        self.group = group
        # Check every tensor's presence and shape against the model before touching any bytes: the same
        # verdict on every rank (all read the same headers), before any collective.
        for binding in bindings:
            for module, leaf, name in binding.params:
                store.check(name, None, tuple(getattr(module, leaf).shape))

        def infos(binding: PartBinding):
            return [(name, store.info(name)) for _, _, name in binding.params]

        self.layouts = [
            build_part_layout(
                b.key,
                [ParamSpec(name, config.dtype_of(name, dtype), shape) for name, (dtype, shape) in infos(b)],
                config.world_size,
                config.align,
            )
            for b in bindings
        ]
        self.digest = layout_digest(self.layouts)
        if config.mode is OffloadMode.LOCAL and any(
            p.spec.dtype != store.info(p.spec.name)[0] for layout in self.layouts for p in layout.params
        ):
            raise ValueError("local mode streams the stored bytes: it cannot cast them to another dtype")
        self._verify_digest()
        source = FetchSource(config.mode, self.layouts, config.rank, config.world_size, group)
        source.staged = _gathers_through_host(config, device, group)
        if config.mode is OffloadMode.LOCAL:
            source.local = [local_sources(layout, store) for layout in self.layouts]
            source.reader = FileReader([piece.path for pieces in source.local for piece in pieces])
        else:
            shard_device = device if config.mode is OffloadMode.SHARDED else None
            source.host = HostShards(self.layouts, store, config.rank, shard_device)
        self.source = source
        self.scheduler = SlotScheduler([b.lane for b in bindings], dict(config.lane_slots))
        self.slot_bytes = slot_sizes(self.layouts, [b.lane for b in bindings], dict(config.lane_slots))
        self.slots = [torch.empty(size, dtype=torch.uint8, device=device) for size in self.slot_bytes]
        self.counters = Counters()
        self.backend = self._make_backend(source)
        lanes = self.scheduler.slot_lane
        self._views = [
            {
                s: self._param_views(b, layout, self.slots[s])
                for s in range(len(self.slots))
                if lanes[s] == b.lane
            }
            for b, layout in zip(bindings, self.layouts, strict=True)
        ]
        self._order: list[int] = []
        self._pos = 0
        self._handles: dict[int, object] = {}  # part -> backend handle of its fetch in flight

    def _make_backend(self, source: FetchSource):
        if self.device.type == "cuda":
            from cosmos3_batch.engine.cuda_backend import CudaBackend

            return CudaBackend(source, self.slots, self.device)
        return CpuBackend(source, self.slots)

    def _verify_digest(self) -> None:
        if self.config.world_size == 1:
            return
        # Sized by the group, not by our config: a rank configured with the wrong world size must get the
        # same clear error as the others, not an IndexError inside the exchange.
        digests: list[str | None] = [None] * dist.get_world_size(self.group)
        with collective_call("the layout digests' exchange"):
            dist.all_gather_object(digests, self.digest, group=self.group)
        if len(set(digests)) != 1 or len(digests) != self.config.world_size:
            ranks = ", ".join(f"rank {r}: {str(d)[:12]}" for r, d in enumerate(digests))
            raise LayoutMismatch(
                f"layer layouts differ across ranks (different checkpoints or versions?): {ranks}"
            )

    @staticmethod
    def _param_views(binding: PartBinding, layout: PartLayout, slot: torch.Tensor):
        # Built once: switching a part to a slot is then only dict assignments, no allocation per layer.
        views = []
        # By name, not position: the layout groups parameters by dtype, so a part holding two dtypes (FP8
        # weights and their float32 scales) is laid out in another order than the binding lists them.
        places = {place.spec.name: place for place in layout.params}
        assert len(places) == len(binding.params), binding.key
        for module, leaf, name in binding.params:
            place = places[name]
            raw = slot[place.offset : place.offset + place.spec.nbytes]
            tensor = raw.view(place.spec.dtype).view(place.spec.shape)
            views.append((module._parameters, leaf, torch.nn.Parameter(tensor, requires_grad=False)))
        return views

    def begin_pass(self, order: Sequence[int], prefetch: Sequence[int] = ()) -> None:
        """Start a pass over `order`. `prefetch`: parts the next pass will begin with in their lane (fetched
        as soon as a slot frees, possibly before this pass ends); the next `order` that has parts of that lane
        must start with them. A pass with none of a lane's parts (a UND-only pass) leaves that lane's
        prefetched parts in their slots for a later pass; its own `prefetch` must not ask for them again."""
        if self._pos != len(self._order):
            raise RuntimeError("begin_pass before the previous pass acquired all its parts")
        ahead = {lane: self.scheduler.outstanding(lane) for lane in self.scheduler.slot_lane}
        for lane, parts in ahead.items():
            in_order = [p for p in order if self.scheduler.lane_of[p] == lane][: len(parts)]
            if in_order != parts and (in_order or set(parts) & set(prefetch)):
                raise RuntimeError(f"lane '{lane}': prefetched parts {parts} are not where this pass starts")
        early = {p for parts in ahead.values() for p in parts}
        self._order, self._pos = list(order), 0
        for part in [*(p for p in order if p not in early), *prefetch]:
            self.scheduler.want(part)
        self._pump()

    def _pump(self) -> None:
        for part, slot in self.scheduler.pump():
            self._handles[part] = self.backend.submit(part, slot)

    def acquire(self, index: int) -> None:
        """Block compute until part `index` is in its slot, point its parameters there, fetch ahead."""
        if self._pos >= len(self._order) or self._order[self._pos] != index:
            raise RuntimeError(
                f"part {index} acquired out of order (pass order {self._order}, at {self._pos})"
            )
        if not self.scheduler.issued(index) and (held := self.scheduler.free_held()) is not None:
            self.backend.release(held)  # its lane's one slot held the part before it (slots.py free_held)
            self._pump()
        slot, freed = self.scheduler.acquire(index)
        if freed is not None:
            # Everything that reads the freed slot (the part before this one) has been issued on the
            # compute stream by now: fence it, so a fetch cannot overwrite weights still in use (a no-op on
            # CPU, an event on CUDA).
            self.backend.release(freed)
        self.backend.wait(self._handles.pop(index), slot)
        h2d, gathered = fetch_bytes(self.source, index)
        self.counters.h2d_bytes += h2d
        self.counters.gathered_bytes += gathered
        self.counters.fetches += 1
        for params, leaf, param in self._views[index][slot]:
            params[leaf] = param
        self._pos += 1
        self._pump()

    def end_pass(self) -> Counters:
        """Called once after the pass's last part was computed (issued): frees its slot, starts what can
        start, and returns this pass's counters (on CUDA, times of passes whose events have completed)."""
        freed = self.scheduler.end_pass()
        if freed is not None:
            self.backend.release(freed)  # the last part's compute is issued: same fence as in acquire
        self.backend.end_pass(self.counters)
        self._pump()
        return self.counters.take()

    def collect(self) -> Counters:
        """Between passes: the times of ended passes not read yet because their events had not completed.
        For benchmarks and tests after their final synchronize; the runner needs none (every end_pass
        returns what has completed by then, and nothing is lost)."""
        self.backend.end_pass(self.counters)  # an empty pass, then every completed one is read
        return self.counters.take()

    def drain(self) -> Counters:
        """After the last pass: the times of every pass not read yet (CUDA: their events waited for, up to
        close_timeout_s; a dead peer's stuck gather leaves its pass unread rather than hang)."""
        if not self.backend.drain(self.counters, self.config.close_timeout_s):
            log.warning("device times of the last passes not read: their events did not complete")
        return self.counters.take()

    def close(self) -> None:
        # Fetches still in flight (the next pass's prefetch at the end of a run) are issued on every rank
        # alike, so they complete; a dead peer is why close() waits with a deadline, never forever.
        clean = self.backend.close(self.config.close_timeout_s)
        if self.source.reader is not None and clean:  # a stuck copy may still read through its descriptors
            self.source.reader.close()


def _gathers_through_host(config: OffloadConfig, device: torch.device, group) -> bool:
    """Ranks sharing one GPU talk through gloo (NCCL refuses two ranks on a device), and gloo has no in-place
    AllGather of CUDA tensors: an allgather part is then gathered in host memory and copied whole."""
    if device.type != "cuda" or config.world_size == 1 or config.mode is OffloadMode.LOCAL:
        return False
    if dist.get_backend(group) != "gloo":
        return False
    if config.mode is OffloadMode.SHARDED:
        raise ValueError("--offload sharded gathers device shards: it needs NCCL, not ranks sharing a GPU")
    return True


def slot_sizes(layouts: list[PartLayout], lanes: list[str], lane_slots: dict[str, int]) -> list[int]:
    """Bytes of each device slot, in slot order: a lane's slots are sized to its largest part. The sum is
    the engine's device memory for weights (plan/planner.py: add these, not 2 x the largest part)."""
    scheduler = SlotScheduler(lanes, lane_slots)
    largest: dict[str, int] = {}
    for layout, lane in zip(layouts, lanes, strict=True):
        largest[lane] = max(largest.get(lane, 0), layout.nbytes)
    return [largest[lane] for lane in scheduler.slot_lane]


__all__ = ["CheckpointFileError", "LayerOffload", "OffloadConfig", "OffloadMode", "PartBinding"]
