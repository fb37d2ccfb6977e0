"""This rank's shards of the layer parts, in one arena on the host, read from the mapped checkpoint.

A rank copies only the byte ranges of its shards out of the memory-mapped files (checkpoint/reader.py); the
pages it touches live in the page cache that the node's ranks share. Private memory per rank is the
arena alone (about 1/N of the layer bytes).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import NamedTuple

import torch

from cosmos3_batch.checkpoint.reader import DTYPES, CheckpointFileError, SafetensorsFile, TensorStore
from cosmos3_batch.engine.layout import ParamSpec, PartLayout

__all__ = [
    "DTYPES",
    "CheckpointFileError",
    "FileReader",
    "HostShards",
    "LocalPiece",
    "SafetensorsFile",
    "TensorStore",
    "local_sources",
]
log = logging.getLogger(__name__)


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
                self.arena[dst : dst + stop - start].copy_(_stored_bytes(store, place.spec, start, stop))
        if device is not None and device.type != "cpu":
            self.arena = self.arena.to(device)  # `sharded` mode: shards live on the device
        self._sizes = [part.shard_bytes for part in layouts]

    def shard(self, index: int) -> torch.Tensor:
        base = self.offsets[index]
        return self.arena[base : base + self._sizes[index]]


def _stored_bytes(store: TensorStore, spec: ParamSpec, start: int, stop: int) -> torch.Tensor:
    """Bytes [start, stop) of parameter `spec` in its layout dtype: the stored bytes, or (`--dtype`) the
    stored elements they hold, cast. Piece bounds are ALIGN-aligned (or the parameter's end), so they
    fall on element boundaries in either dtype; only this rank's elements are read and cast."""
    stored = store.info(spec.name)[0]
    raw = store.byte_view(spec.name)
    if stored == spec.dtype:
        return raw[start:stop]
    size, item = stored.itemsize, spec.dtype.itemsize
    assert start % item == 0 and stop % item == 0, (spec.name, start, stop)
    elements = raw[start // item * size : stop // item * size].clone()  # clone: an aligned buffer to view
    return elements.view(stored).to(spec.dtype).view(torch.uint8)


class LocalPiece(NamedTuple):
    """One parameter of a part in `local` mode: where its bytes are in the checkpoint and in the part."""

    data: torch.Tensor  # the bytes as mapped: registered for DMA on CUDA (engine/cuda_backend.py)
    offset: int  # where they go in the part buffer
    path: Path  # the file, for `FileReader`
    file_offset: int  # where they start in it


def local_sources(layout: PartLayout, store: TensorStore) -> list[LocalPiece]:
    """Where `local` mode reads a whole part from: one piece per parameter."""
    pieces = []
    for place in layout.params:
        file = store.file_of(place.spec.name)
        start = file.tensors[place.spec.name][2]
        pieces.append(LocalPiece(store.byte_view(place.spec.name), place.offset, file.path, start))
    return pieces


class FileReader:
    """`local` mode's host reads, with pread from the files rather than loads from their mapping.

    A checkpoint file truncated under the job makes a load from its mapping beyond the new end a SIGBUS
    that kills the rank (and hangs its peers until the collective timeout); pread just returns short. A
    short read is zero-filled and counted: the checkpoint watch (checkpoint/watch.py) sees the change after
    the pass and stops the job before anything computed from it is written. In the page cache, pread costs
    what the copy out of the mapping did (scripts/bench/local_read.py). Thread-safe: one descriptor per
    file, opened up front, and pread has no file position."""

    def __init__(self, paths: list[Path]):
        self._fds = {path: os.open(path, os.O_RDONLY | os.O_CLOEXEC) for path in dict.fromkeys(paths)}
        self.short_reads = 0

    def read(self, piece: LocalPiece, dst: torch.Tensor, start: int = 0) -> None:
        """Fill `dst` (host bytes) with the piece's bytes from `start` on."""
        view = memoryview(dst.numpy())
        done, fd, base = 0, self._fds[piece.path], piece.file_offset + start
        while done < len(view):
            got = os.preadv(fd, [view[done:]], base + done)
            if got == 0:  # the file ends early: it was truncated after it was loaded
                view[done:] = bytes(len(view) - done)
                self.short_reads += 1
                if self.short_reads == 1:  # once: the checkpoint watch stops the job after this pass
                    log.warning(
                        "%s ends before byte %d: truncated while the job runs", piece.path, base + done
                    )
                return
            done += got

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
