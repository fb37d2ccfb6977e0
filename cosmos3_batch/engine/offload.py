"""The DLO engine's face: an ordered list of layer parts, fetched one ahead into two slots.

Model-agnostic: a part is a key and the (module, parameter name, checkpoint name) triples it owns.
Usage per pass: `begin_pass(order)` with the part indices the pass will compute, then `acquire(i)`
for each in that order: it waits for part i, re-points its parameters at the slot, and starts the
fetch of the next part into the other slot, so transfer k+1 overlaps compute k.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cosmos3_batch.engine.host import CheckpointFileError, HostShards, TensorStore, local_sources
from cosmos3_batch.engine.layout import ALIGN, ParamSpec, PartLayout, build_part_layout, layout_digest
from cosmos3_batch.engine.transport import Counters, CpuBackend, FetchSource, OffloadMode


@dataclass(frozen=True)
class PartBinding:
    key: str
    params: tuple[tuple[torch.nn.Module, str, str], ...]  # (owning module, leaf name, checkpoint name)


@dataclass(frozen=True)
class OffloadConfig:
    mode: OffloadMode = OffloadMode.ALLGATHER
    rank: int = 0
    world_size: int = 1
    align: int = ALIGN

    def __post_init__(self) -> None:
        if self.mode is OffloadMode.RESIDENT:
            raise ValueError("resident mode needs no offload engine")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of {self.world_size}")


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
        self.layouts = [
            build_part_layout(
                b.key,
                [ParamSpec(name, *store.info(name)) for _, _, name in b.params],
                config.world_size,
                config.align,
            )
            for b in bindings
        ]
        self.digest = layout_digest(self.layouts)
        self._verify_digest()
        source = FetchSource(config.mode, self.layouts, config.rank, config.world_size, group)
        if config.mode is OffloadMode.LOCAL:
            source.local = [local_sources(layout, store) for layout in self.layouts]
        else:
            shard_device = device if config.mode is OffloadMode.SHARDED else None
            source.host = HostShards(self.layouts, store, config.rank, shard_device)
        slot_bytes = max(layout.nbytes for layout in self.layouts)
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.counters = Counters()
        self.backend = self._make_backend(source)
        self._views = [
            [self._param_views(b, layout, slot) for slot in self.slots]
            for b, layout in zip(bindings, self.layouts, strict=True)
        ]
        self._order: list[int] = []
        self._pos = 0
        self._pending: dict[int, tuple[int, object]] = {}
        self._next_slot = 0

    def _make_backend(self, source: FetchSource):
        if self.device.type == "cuda":
            from cosmos3_batch.engine.cuda_backend import CudaBackend

            return CudaBackend(source, self.slots, self.counters, self.device)
        return CpuBackend(source, self.slots, self.counters)

    def _verify_digest(self) -> None:
        if self.config.world_size == 1:
            return
        # Sized by the group, not by our config: a rank configured with the wrong world size must get the
        # same clear error as the others, not an IndexError inside the exchange.
        digests: list[str | None] = [None] * dist.get_world_size(self.group)
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
        for (module, leaf, _), place in zip(binding.params, layout.params, strict=True):
            raw = slot[place.offset : place.offset + place.spec.nbytes]
            tensor = raw.view(place.spec.dtype).view(place.spec.shape)
            views.append((module._parameters, leaf, torch.nn.Parameter(tensor, requires_grad=False)))
        return views

    def begin_pass(self, order: list[int]) -> None:
        assert not self._pending, "previous pass left fetches in flight"
        self._order, self._pos = order, 0
        if order:
            self._submit(order[0])

    def _submit(self, index: int) -> None:
        slot = self._next_slot
        self._next_slot ^= 1
        # Every compute that read this slot (two parts ago) has been issued by now: fence it, so the fetch
        # cannot overwrite weights still in use (a no-op on CPU, an event on CUDA).
        self.backend.release(slot)
        self._pending[index] = (slot, self.backend.submit(index, slot))

    def acquire(self, index: int) -> None:
        """Block compute until part `index` is in its slot, point its parameters there, prefetch the next."""
        assert self._pos < len(self._order) and self._order[self._pos] == index, "parts acquired out of order"
        slot, handle = self._pending.pop(index)
        start = time.perf_counter()
        self.backend.wait(handle, slot)
        self.counters.stall_s += time.perf_counter() - start
        for params, leaf, param in self._views[index][slot]:
            params[leaf] = param
        self._pos += 1
        if self._pos < len(self._order):
            self._submit(self._order[self._pos])

    def close(self) -> None:
        self.backend.close()


__all__ = ["CheckpointFileError", "LayerOffload", "OffloadConfig", "OffloadMode", "PartBinding"]
