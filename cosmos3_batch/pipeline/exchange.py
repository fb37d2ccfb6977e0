"""The one collective per pass (DESIGN.md §4): a small all-reduce on a host (gloo) group, and the trace of the
collectives the pass loop issues (equal on every rank: the tests compare them)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cosmos3_batch.parallel.stall import Place
from cosmos3_batch.plan.prefill import SlotReport


@dataclass(frozen=True)
class Exchanged:
    """What the per-pass all-reduce tells every rank about the whole world (sums over ranks)."""

    active: int  # requests active on all ranks this pass (before this pass's admissions)
    starved: int  # free slots that no prefilled request can fill while requests are queued
    overdue: int  # ranks whose starved slot has waited --prefill-max-wait passes
    pending: int  # requests queued or prefilled, not yet active
    und: bool  # some active request needs the UND parts anyway (the --no-und-cache ablation)
    finished: int  # requests reported (written or failed) on all ranks since the last pass
    stop: bool  # some rank was asked to stop (SIGINT / SIGTERM)


class PassSync:
    """The one collective per pass. Also keeps a trace of the collectives the pass loop issues.

    The group is a host (gloo) group on every backend: seven integers need no device, and a device tensor
    here would cost two device syncs per pass (the copy in and `.tolist()`).

    Two traces: every collective the pass loop's thread issues on every rank of its --sp group alike (its
    group's all-to-alls and agreements and its encodes' broadcasts too, not their halo messages nor the
    finisher's decodes: equal within a group), and the world-wide ones alone (the all-reduce and the part
    fetches: equal on every rank)."""

    def __init__(self, world_size: int = 1, group=None, place: Place | None = None):
        self.world_size = world_size
        self.group = group
        self.place = place  # where the loop is, for the line that ends a job whose peer stalled
        self.all_reduces = 0
        self._trace = hashlib.sha256()
        self._world_trace = hashlib.sha256()

    def exchange(
        self, active: int, slots: SlotReport, needs_und: bool, finished: int, stop: bool = False
    ) -> Exchanged:
        self.all_reduces += 1
        self.note_world("all_reduce:7")
        values = [active, slots.starved, slots.overdue, slots.pending, int(needs_und), finished, int(stop)]
        if self.world_size > 1:
            tensor = torch.tensor(values, dtype=torch.int64)
            dist.all_reduce(tensor, group=self.group)
            values = tensor.tolist()
        total, starved, overdue, pending, und, done, stops = values
        return Exchanged(total, starved, overdue, pending, und > 0, done, stops > 0)

    def note(self, event: str) -> None:
        self._trace.update(event.encode() + b";")
        if self.place is not None:
            self.place.note(event)

    def note_world(self, event: str) -> None:
        self.note(event)
        self._world_trace.update(event.encode() + b";")

    @property
    def trace_digest(self) -> str:
        return self._trace.hexdigest()

    @property
    def world_trace_digest(self) -> str:
        return self._world_trace.hexdigest()
