"""Flat byte layout of each layer part, cut into equal per-rank shards.

A part (for Cosmos3: one layer's UND or GEN half) becomes one contiguous byte buffer:

    [ dtype group 0: param | pad to ALIGN | param | pad ... ][ dtype group 1 ... ][ pad to world x ALIGN ]

Rank r owns bytes [r * shard, (r + 1) * shard). One in-place AllGather of the whole buffer rebuilds the
part on every rank, whatever its dtypes, and each parameter is a view at an aligned byte offset (so
`.view(dtype)` is legal and kernels get aligned pointers). A parameter may straddle two ranks' shards;
nothing cares.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

ALIGN = 256  # bytes: keeps every dtype group (and every shard) aligned for vectorised device kernels


@dataclass(frozen=True)
class ParamSpec:
    name: str  # checkpoint name, e.g. "layers.3.mlp_moe_gen.up_proj.weight"
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.dtype.itemsize


@dataclass(frozen=True)
class ParamPlace:
    spec: ParamSpec
    offset: int  # byte offset in the part buffer: a multiple of ALIGN


@dataclass(frozen=True)
class PartLayout:
    key: str  # e.g. "3.gen"
    params: tuple[ParamPlace, ...]
    nbytes: int  # padded size: a multiple of world_size * ALIGN
    world_size: int

    @property
    def shard_bytes(self) -> int:
        return self.nbytes // self.world_size

    @property
    def payload_bytes(self) -> int:
        return sum(p.spec.nbytes for p in self.params)

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_bytes, (rank + 1) * self.shard_bytes

    def pieces_for_rank(self, rank: int) -> list[tuple[ParamPlace, int, int]]:
        """(param, start, stop) byte ranges *within the param* that fall in `rank`'s shard."""
        lo, hi = self.shard_range(rank)
        pieces = []
        for place in self.params:
            start, stop = max(lo, place.offset), min(hi, place.offset + place.spec.nbytes)
            if start < stop:
                pieces.append((place, start - place.offset, stop - place.offset))
        return pieces


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def build_part_layout(key: str, params: list[ParamSpec], world_size: int, align: int = ALIGN) -> PartLayout:
    """Group by dtype (in order of first appearance), keep the given order inside a group, pad, shard."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    groups: dict[torch.dtype, list[ParamSpec]] = {}
    for spec in params:
        groups.setdefault(spec.dtype, []).append(spec)
    places, offset = [], 0
    for specs in groups.values():
        for spec in specs:
            # Every parameter, not only every dtype group, starts on an ALIGN boundary: cuBLASLt and the
            # vectorised kernels read faster (some only) from 256-byte aligned pointers. < ALIGN per param.
            offset = _round_up(offset, align)
            places.append(ParamPlace(spec, offset))
            offset += spec.nbytes
    total = _round_up(max(offset, 1), world_size * align)
    return PartLayout(key=key, params=tuple(places), nbytes=total, world_size=world_size)


def layout_digest(layouts: list[PartLayout]) -> str:
    """Identical on every rank iff every rank will move the same bytes to the same places."""
    canon = [
        [
            part.key,
            part.nbytes,
            part.world_size,
            [[p.spec.name, str(p.spec.dtype), p.spec.shape, p.offset] for p in part.params],
        ]
        for part in layouts
    ]
    return hashlib.sha256(json.dumps(canon).encode()).hexdigest()
