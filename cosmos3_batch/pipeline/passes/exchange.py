"""The one collective per pass (DESIGN.md §4): a small all-reduce on a host (gloo) group, and the trace of the
collectives the pass loop issues (equal on every rank: the tests compare them)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cosmos3_batch.engine.transport import collective_call
from cosmos3_batch.parallel.stall import Place, phase
from cosmos3_batch.parallel.waiting import WaitMark, peers
from cosmos3_batch.plan.prefill import SlotReport


@dataclass(frozen=True)
class Exchanged:
    """What the per-pass all-reduce tells every rank about the whole world (sums over ranks)."""

    active: int  # requests active on all ranks this pass (before this pass's admissions)
    starved: int  # free generation slots that no prefilled request can fill while such requests are queued
    overdue: int  # ranks whose starved slot has waited --prefill-max-wait passes
    pending: int  # requests queued or prefilled, not yet active
    und: bool  # some active request needs the UND parts anyway (the --no-und-cache ablation)
    finished: int  # requests reported (written or failed) on all ranks since the last pass
    stop: bool  # some rank was asked to stop (SIGINT / SIGTERM)
    # The live figures (passes/monitor.py), carried by the same all-reduce: no collective of their own.
    failed: int = 0  # of `finished`, those that failed
    weight_bytes: int = 0  # moved by all ranks in the previous pass (host->device + gathered)
    stall_s: float = 0.0  # compute waited for a layer part in the previous pass, summed over ranks
    waited_s: tuple[float, ...] = ()  # per rank: how long it waited in the previous exchange (the last to
    # arrive waited least: max(waited_s) - waited_s[r] is how far rank r lagged the first to arrive)
    computing: int = 0  # branches of active requests that run the decoder stack this pass (--cache sea)
    # Requests with GEN work that the ranks admit if this is a UND pass (a reasoner's has none): with
    # `computing`, whether the pass fetches the GEN parts (runner.py `_fetches`).
    admits_gen: int = 0
    reason_starved: int = 0  # `starved` of the reasoner slots (--max-reason-active)


@dataclass(frozen=True)
class Figures:
    """This rank's share of the live figures, sent with its pass flags."""

    failed: int = 0  # requests reported failed on this rank since the last exchange
    weight_bytes: int = 0  # moved by this rank in its last pass
    stall_s: float = 0.0  # its compute waited for parts in its last pass


EXCHANGE = phase("all_reduce")  # "the per-pass exchange", as the line that ends a stalled job says it
# [active, starved, overdue, pending, needs-UND, finished, stop, computing branches, GEN admissions,
#  starved reasoner slots]
FLAGS = 10
FIGURES = 3  # [failed, weight bytes, stall microseconds]; then one slot per rank: its last wait, in ms


class PassSync:
    """The one collective per pass. Also keeps a trace of the collectives the pass loop issues.

    The group is a host (gloo) group on every backend: 13 + world-size integers need no device, and a device
    tensor here would cost two device syncs per pass (the copy in and `.tolist()`). Each rank writes its
    last wait into its own slot (zeros elsewhere), so the sum is every rank's value.

    Two traces: every collective the pass loop's thread issues on every rank of its --sp group alike (its
    group's all-to-alls and agreements and its encodes' broadcasts too, not their halo messages nor the
    finisher's decodes: equal within a group), and the world-wide ones alone (the all-reduce and the part
    fetches: equal on every rank)."""

    def __init__(self, world_size: int = 1, group=None, place: Place | None = None, rank: int = 0):
        self.world_size = world_size
        self.group = group
        self.place = place  # where the loop is, for the line that ends a job whose peer stalled
        self.rank = rank
        self.all_reduces = 0
        self.waiting_since: float | None = None  # monotonic: this rank is in the exchange since then
        self.last_exchange = time.monotonic()  # when the last exchange ended (every rank was there)
        # What the pass loop's thread waits for (the exchange, a layer part, an --sp all-to-all, a VAE group
        # message), and the other threads' marks (a group decode's): rank 0's monitor reads them.
        self.waiting = WaitMark()
        self.marks = [self.waiting]
        self._waited_s = 0.0
        self._reads: dict[str, tuple[str, str]] = {}  # host_read's labels: (place event, wait label)
        self._trace = hashlib.sha256()
        self._world_trace = hashlib.sha256()

    def exchange(
        self,
        active: int,
        slots: SlotReport,
        needs_und: bool,
        finished: int,
        stop: bool = False,
        figures: Figures = Figures(),
        computing: int = 0,
        admits_gen: int = 0,
    ) -> Exchanged:
        self.all_reduces += 1
        self.note_world(f"all_reduce:{FLAGS + FIGURES + self.world_size}")
        values = [active, slots.starved, slots.overdue, slots.pending, int(needs_und), finished, int(stop)]
        values += [computing, admits_gen, slots.reason_starved]
        values += [figures.failed, figures.weight_bytes, round(figures.stall_s * 1e6)]
        waits = [0] * self.world_size
        waits[self.rank] = round(self._waited_s * 1e3)
        values += waits
        self.waiting_since = time.monotonic()
        if self.world_size > 1:
            tensor = torch.tensor(values, dtype=torch.int64)
            with self.waiting.waiting(EXCHANGE, peers(self.world_size)), collective_call(EXCHANGE):
                dist.all_reduce(tensor, group=self.group)
            values = tensor.tolist()
        self.last_exchange = time.monotonic()
        self._waited_s, self.waiting_since = self.last_exchange - self.waiting_since, None
        flags, (failed, moved, stall_us) = values[:FLAGS], values[FLAGS : FLAGS + FIGURES]
        total, starved, overdue, pending, und, done, stops, computing, admits_gen, reason_starved = flags
        waited = tuple(ms / 1e3 for ms in values[FLAGS + FIGURES :])
        return Exchanged(
            total, starved, overdue, pending, und > 0, done, stops > 0, failed, moved, stall_us / 1e6, waited,
            computing=computing, admits_gen=admits_gen, reason_starved=reason_starved,
        )  # fmt: skip

    def host_read(self, what: str) -> WaitMark:
        """Around a point where the loop's host blocks on the device (a GPU only: on CPU it returns at once).
        No collective is issued there, but one a peer stalled may hold the stream it waits for: the wait is
        marked for rank 0's monitor and the place is kept for the line that ends the job (no trace entry)."""
        if (labels := self._reads.get(what)) is None:  # formatted once per kind of read, not per pass
            event = f"read:{what}"
            labels = self._reads[what] = (event, phase(event))
        if self.place is not None:
            self.place.event = labels[0]
        return self.waiting.waiting(labels[1])

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
