"""The pass loop (DESIGN.md §4): collectives that do not depend on the requests.

Every pass, on every rank:
1. one small all-reduce on a host (gloo) group: [active sequences, needs-UND flag, finished count,
   stop flag]; a global active count of 0, or a stop flag from any rank (SIGINT/SIGTERM), ends the run
   on every rank at the same pass;
2. walk layers 0..L-1 fetching the same parts in the same order (GEN always, UND only if some rank
   flagged it): a rank with nothing active only takes part in the transfers;
3. apply each part to all of this rank's active branches;
4. finish each request's step on its own (head, CFG, its scheduler), decode and write finished ones,
   admit new ones up to `max_active`.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
import torch.distributed as dist

from cosmos3_batch.engine.transport import Counters
from cosmos3_batch.model.cosmos3 import GEN, UND
from cosmos3_batch.pipeline.context import ModelContext
from cosmos3_batch.pipeline.denoise import RequestJob, Result
from cosmos3_batch.pipeline.finisher import Finisher
from cosmos3_batch.pipeline.stop import StopRequest

if TYPE_CHECKING:
    from cosmos3_batch.requests import Request

# on_finished(job, result, error): exactly one of result / error is set.
FinishedCallback = Callable[[RequestJob, Result | None, str | None], None]


class LayerWeights(Protocol):
    def begin_pass(self, und: bool) -> None: ...
    def layer(self, index: int, part: str) -> torch.nn.Module: ...
    def end_pass(self) -> Counters: ...


@dataclass(frozen=True)
class Exchanged:
    """What the per-pass all-reduce tells every rank about the whole world."""

    active: int  # sequences (requests) active on all ranks this pass
    und: bool  # some rank needs the UND parts this pass
    finished: int  # requests reported (written or failed) on all ranks since the last pass
    stop: bool  # some rank was asked to stop (SIGINT / SIGTERM)


class PassRecord(NamedTuple):
    """One pass on this rank, as the run report draws it (columns of passes.*.csv)."""

    index: int
    start_s: float  # since the pass loop began on this rank
    duration_s: float  # walking the layers: fetch waits + compute
    und: bool  # the UND parts were fetched
    active: int  # requests that rode on this pass
    stall_s: float  # compute waited for a part
    weight_bytes: int  # host->device + gathered on this rank


class PassSync:
    """The one collective per pass. Also keeps a trace of every collective this rank issues.

    The group is a host (gloo) group on every backend: four integers need no device, and a device tensor
    here would cost two device syncs per pass (the copy in and `.tolist()`)."""

    def __init__(self, world_size: int = 1, group=None):
        self.world_size = world_size
        self.group = group
        self.all_reduces = 0
        self._trace = hashlib.sha256()

    def exchange(self, active: int, needs_und: bool, finished: int, stop: bool = False) -> Exchanged:
        self.all_reduces += 1
        self.note("all_reduce:4")
        if self.world_size == 1:
            return Exchanged(active, needs_und, finished, stop)
        values = torch.tensor([active, int(needs_und), finished, int(stop)], dtype=torch.int64)
        dist.all_reduce(values, group=self.group)
        total_active, und_ranks, total_finished, stops = values.tolist()
        return Exchanged(total_active, und_ranks > 0, total_finished, stops > 0)

    def note(self, event: str) -> None:
        self._trace.update(event.encode() + b";")

    @property
    def trace_digest(self) -> str:
        return self._trace.hexdigest()


class PassRunner:
    def __init__(
        self,
        ctx: ModelContext,
        weights: LayerWeights,
        max_active: int,
        on_finished: FinishedCallback,
        sync: PassSync | None = None,
        on_progress: Callable[[int], None] | None = None,
        und_cache: bool = True,
        stop: StopRequest | None = None,
    ):
        if max_active < 1:
            raise ValueError(f"--max-active must be >= 1, got {max_active}")
        self.ctx = ctx
        self.weights = weights
        self.max_active = max_active
        self.on_finished = on_finished
        self.sync = sync if sync is not None else PassSync()
        self.on_progress = on_progress
        self.und_cache = und_cache
        self.stop = stop if stop is not None else StopRequest()
        self.passes = 0
        self.und_passes = 0  # passes that fetched UND parts (some rank admitted a request)
        self.pass_s = 0.0  # wall time walking the layers (fetch waits + compute), summed over passes
        self.und_runs = 0  # UND half applications (layer x branch): once per branch per layer, ever
        self.totals = Counters()
        self.started = time.perf_counter()  # the timeline's zero
        self.timeline: list[PassRecord] = []  # one small record per pass, for the run report
        self.interrupted = False  # the run left the loop on a stop request
        self.abandoned: list[RequestJob] = []  # mid-denoise when the run stopped: redone by the next run
        self.not_started: list[Request] = []  # still queued when the run stopped
        self._reported = 0  # requests reported on this rank since the last exchange (finisher thread)
        self._count_lock = threading.Lock()  # held only to bump or take that count, never during a write
        self.finisher = Finisher(self._report, ctx.device)

    @torch.no_grad()
    def run(self, requests: Iterable[Request]) -> None:
        try:
            self._loop(deque(requests))
        finally:
            # Also when a peer died mid-run: requests already denoised here still get decoded and written.
            self.finisher.close()

    def _loop(self, queue: deque) -> None:
        active: list[RequestJob] = []
        while True:
            if not self.stop.requested:
                active.extend(self._admit(queue, self.max_active - len(active)))
            local_und = any(job.needs_und for job in active)
            with self._count_lock:
                mine, self._reported = self._reported, 0
            world = self.sync.exchange(len(active), local_und, mine, self.stop.requested)
            if self.on_progress is not None and world.finished > mine:
                self.on_progress(world.finished - mine)  # our own were counted as they were written
            if world.stop:
                self.interrupted = True
                self.abandoned, self.not_started = active, list(queue)
                return
            if world.active == 0:
                return
            # Start fetching the first part now, so the transfer overlaps the per-request embedding.
            self.weights.begin_pass(world.und)
            active = self._begin(active)
            self._pass(active, world.und)
            active = self._finish(active)

    def _report(self, job: RequestJob, result: Result | None, error: str | None) -> None:
        # On the finisher thread only (it serializes reports): the loop never waits for a write.
        self.on_finished(job, result, error)
        with self._count_lock:
            self._reported += 1
        if self.on_progress is not None:
            self.on_progress(1)

    def _admit(self, queue: deque, free: int) -> list[RequestJob]:
        admitted = []
        while queue and len(admitted) < free:
            job = RequestJob(self.ctx, queue.popleft(), und_cache=self.und_cache)
            try:
                job.prepare()
            except Exception as exc:  # a bad request must not take the job down
                self.finisher.fail(job, _describe(exc))
                continue
            admitted.append(job)
        return admitted

    def _begin(self, active: list[RequestJob]) -> list[RequestJob]:
        ok = []
        for job in active:
            try:
                job.begin_step()
            except Exception as exc:
                self.finisher.fail(job, _describe(exc))
                continue
            ok.append(job)
        return ok

    def _pass(self, active: list[RequestJob], und_flag: bool) -> None:
        split, weights = self.ctx.split, self.weights
        started = time.perf_counter()
        for index in range(split.num_layers):
            if und_flag:
                self.sync.note(f"part:{index}.{UND}")
                self._apply(active, weights.layer(index, UND), index, UND)
            self.sync.note(f"part:{index}.{GEN}")
            self._apply(active, weights.layer(index, GEN), index, GEN)
        counters = weights.end_pass()
        ended = time.perf_counter()
        self.pass_s += ended - started
        self._account(active, counters)
        self.timeline.append(
            PassRecord(
                self.passes,
                started - self.started,
                ended - started,
                und_flag,
                len(active),
                counters.stall_s,
                counters.h2d_bytes + counters.gathered_bytes,
            )
        )
        self.passes += 1
        self.und_passes += und_flag

    def _apply(self, active: list[RequestJob], layer: torch.nn.Module, index: int, part: str) -> None:
        """One layer part over every wanted branch. A request whose compute fails (e.g. out of memory on its
        largest activation) is marked failed and skipped; the rank keeps walking the layers with the others,
        so its collectives stay aligned."""
        split = self.ctx.split
        is_last = index == split.num_layers - 1
        for job in active:
            if job.error is not None:
                continue
            try:
                for branch in job.branches:
                    if part == GEN:
                        split.gen_layer(layer, branch, index)
                    elif branch.needs_und:
                        split.und_layer(layer, branch, is_last)
                        self.und_runs += 1
            except Exception as exc:
                job.error = _describe(exc)

    def _account(self, active: list[RequestJob], counters: Counters) -> None:
        for name in ("h2d_bytes", "gathered_bytes", "stall_s", "collective_s", "fetches"):
            setattr(self.totals, name, getattr(self.totals, name) + getattr(counters, name))
        # A pass's weight traffic is shared by the requests that rode on it.
        for job in active:
            job.weight_bytes += (counters.h2d_bytes + counters.gathered_bytes) / len(active)
            job.stall_s += counters.stall_s / len(active)

    def _finish(self, active: list[RequestJob]) -> list[RequestJob]:
        still = []
        for job in active:
            if job.error is not None:
                self.finisher.fail(job, job.error)
                continue
            try:
                job.finish_step()
            except Exception as exc:
                self.finisher.fail(job, _describe(exc))
                continue
            if job.done:
                self.finisher.submit(job)  # decode + write off the loop: the other ranks need not wait
            else:
                still.append(job)
        return still


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
