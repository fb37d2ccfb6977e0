"""The pass loop (DESIGN.md §4): collectives that do not depend on the requests.

Every pass, on every rank:
1. one small all-reduce on the main group: [active sequences, needs-UND flag, finished count];
   a global active count of 0 ends the run on every rank at the same pass;
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
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from cosmos3_batch.engine.transport import Counters
from cosmos3_batch.model.cosmos3 import GEN, UND
from cosmos3_batch.pipeline.context import ModelContext
from cosmos3_batch.pipeline.denoise import RequestJob, Result
from cosmos3_batch.pipeline.finisher import Finisher

if TYPE_CHECKING:
    from cosmos3_batch.requests import Request

# on_finished(job, result, error): exactly one of result / error is set.
FinishedCallback = Callable[[RequestJob, Result | None, str | None], None]


class LayerWeights(Protocol):
    def begin_pass(self, und: bool) -> None: ...
    def layer(self, index: int, part: str) -> torch.nn.Module: ...
    def end_pass(self) -> Counters: ...


class PassSync:
    """The one main-group collective per pass. Also keeps a trace of every collective this rank issues."""

    def __init__(self, world_size: int = 1, group=None, device: torch.device | None = None):
        self.world_size = world_size
        self.group = group
        # NCCL reduces device tensors, gloo host tensors.
        self.device = device if device is not None and device.type == "cuda" else torch.device("cpu")
        self.all_reduces = 0
        self._trace = hashlib.sha256()

    def exchange(self, active: int, needs_und: bool, finished: int) -> tuple[int, bool, int]:
        self.all_reduces += 1
        self.note("all_reduce:3")
        if self.world_size == 1:
            return active, needs_und, finished
        values = torch.tensor([active, int(needs_und), finished], dtype=torch.int64, device=self.device)
        dist.all_reduce(values, group=self.group)
        total_active, und_ranks, total_finished = values.tolist()
        return total_active, und_ranks > 0, total_finished

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
        self.passes = 0
        self.und_passes = 0  # passes that fetched UND parts (some rank admitted a request)
        self.pass_s = 0.0  # wall time walking the layers (fetch waits + compute), summed over passes
        self.und_runs = 0  # UND half applications (layer x branch): once per branch per layer, ever
        self.totals = Counters()
        self._finished_since_sync = 0
        self._lock = threading.Lock()
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
            active.extend(self._admit(queue, self.max_active - len(active)))
            if not active:
                self.finisher.drain()  # nothing left here: count our last outputs in this exchange
            local_und = any(job.needs_und for job in active)
            with self._lock:
                finished_here, self._finished_since_sync = self._finished_since_sync, 0
            total, und, finished = self.sync.exchange(len(active), local_und, finished_here)
            if self.on_progress is not None and finished:
                self.on_progress(finished)
            if total == 0:
                return
            # Start fetching the first part now, so the transfer overlaps the per-request embedding.
            self.weights.begin_pass(und)
            active = self._begin(active)
            self._pass(active, und)
            active = self._finish(active)

    def _report(self, job: RequestJob, result: Result | None, error: str | None) -> None:
        # Called from the loop (failures) and from the finisher thread (decoded results): one at a time.
        with self._lock:
            self._finished_since_sync += 1
            self.on_finished(job, result, error)

    def _admit(self, queue: deque, free: int) -> list[RequestJob]:
        admitted = []
        while queue and len(admitted) < free:
            job = RequestJob(self.ctx, queue.popleft(), und_cache=self.und_cache)
            try:
                job.prepare()
            except Exception as exc:  # a bad request must not take the job down
                self._report(job, None, _describe(exc))
                continue
            admitted.append(job)
        return admitted

    def _begin(self, active: list[RequestJob]) -> list[RequestJob]:
        ok = []
        for job in active:
            try:
                job.begin_step()
            except Exception as exc:
                self._report(job, None, _describe(exc))
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
        self.pass_s += time.perf_counter() - started
        self._account(active, counters)
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
                self._report(job, None, job.error)
                continue
            try:
                job.finish_step()
            except Exception as exc:
                self._report(job, None, _describe(exc))
                continue
            if job.done:
                self.finisher.submit(job)  # decode + write off the loop: the other ranks need not wait
            else:
                still.append(job)
        return still


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
