"""This rank's shards of the layer parts, in one arena on the host, read from the mapped checkpoint.

A rank copies only the byte ranges of its shards out of the memory-mapped files (checkpoint/reader.py); the
pages it touches live in the page cache that the node's ranks share. Private memory per rank is the
arena alone (about 1/N of the layer bytes).
"""

from __future__ import annotations

import torch

from cosmos3_batch.checkpoint.reader import DTYPES, CheckpointFileError, SafetensorsFile, TensorStore
from cosmos3_batch.engine.layout import PartLayout

__all__ = ["DTYPES", "CheckpointFileError", "HostShards", "SafetensorsFile", "TensorStore", "local_sources"]


class HostShards:
    """This rank's shard of every part, packed back to back in one exact-size arena.

    One allocation (not one per layer) so that pinning it on CUDA is one registration of exactly
    the bytes we use: torch's pinned allocator would round each block up to a power of two.
    """

    def __init__(
        self, layouts: list[PartLayout], store: TensorStore, rank: int, device: torch.device | None = None
    ):
        self.offsets = []
        total = 0
        for part in layouts:
            self.offsets.append(total)
            total += part.shard_bytes
        # Zeros, so that padding bytes are defined (they are gathered like any other byte).
        self.arena = torch.zeros(total, dtype=torch.uint8)
        for part, base in zip(layouts, self.offsets, strict=True):
            lo, _ = part.shard_range(rank)
            for place, start, stop in part.pieces_for_rank(rank):
                dst = base + place.offset + start - lo
                self.arena[dst : dst + stop - start].copy_(store.byte_view(place.spec.name)[start:stop])
        if device is not None and device.type != "cpu":
            self.arena = self.arena.to(device)  # `sharded` mode: shards live on the device
        self._sizes = [part.shard_bytes for part in layouts]

    def shard(self, index: int) -> torch.Tensor:
        base = self.offsets[index]
        return self.arena[base : base + self._sizes[index]]


def local_sources(layout: PartLayout, store: TensorStore) -> list[tuple[torch.Tensor, int]]:
    """(mmap'd bytes, offset in the part buffer) for `local` mode: whole parts read from the page cache."""
    return [(store.byte_view(place.spec.name), place.offset) for place in layout.params]
