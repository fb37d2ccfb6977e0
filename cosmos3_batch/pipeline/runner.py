"""The pass loop: every pass walks all layers once and applies each to every active sequence.

A pass = for each layer l: (UND half of l, if some branch still needs its UND K/V) then GEN half of l,
applied to all active branches; then each request finishes its step on its own (head, CFG, its own
scheduler), finished requests are decoded and written, and new ones are admitted up to
`max_active`. Weights are asked for in the same order in every pass whatever the requests are,
which is what lets ranks gather layers in lockstep.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

import torch

from cosmos3_batch.pipeline.context import ModelContext
from cosmos3_batch.pipeline.denoise import RequestJob, Result

if TYPE_CHECKING:
    from cosmos3_batch.requests import Request

UND, GEN = "und", "gen"

# on_finished(job, result, error): exactly one of result / error is set.
FinishedCallback = Callable[[RequestJob, Result | None, str | None], None]


class LayerWeights(Protocol):
    """Hands out a layer whose `part` (UND or GEN) parameters are ready for compute."""

    def layer(self, index: int, part: str) -> torch.nn.Module: ...


class ResidentWeights:
    """All layers live on the device: the baseline every offload mode is compared with."""

    def __init__(self, layers: torch.nn.ModuleList):
        self.layers = layers

    def layer(self, index: int, part: str) -> torch.nn.Module:
        return self.layers[index]


class PassRunner:
    def __init__(
        self, ctx: ModelContext, weights: LayerWeights, max_active: int, on_finished: FinishedCallback
    ):
        if max_active < 1:
            raise ValueError(f"--max-active must be >= 1, got {max_active}")
        self.ctx = ctx
        self.weights = weights
        self.max_active = max_active
        self.on_finished = on_finished
        self.passes = 0
        self.und_runs = 0  # UND half applications (layer x branch): once per branch per layer, ever

    @torch.no_grad()
    def run(self, requests: Iterable[Request]) -> None:
        queue = deque(requests)
        active: list[RequestJob] = []
        while True:
            active.extend(self._admit(queue, self.max_active - len(active)))
            if not active:
                return
            active = self._begin(active)
            self._pass(active)
            active = self._finish(active)

    def _admit(self, queue: deque, free: int) -> list[RequestJob]:
        admitted = []
        while queue and len(admitted) < free:
            job = RequestJob(self.ctx, queue.popleft())
            try:
                job.prepare()
            except Exception as exc:  # a bad request must not take the job down
                self.on_finished(job, None, _describe(exc))
                continue
            admitted.append(job)
        return admitted

    def _begin(self, active: list[RequestJob]) -> list[RequestJob]:
        ok = []
        for job in active:
            try:
                job.begin_step()
            except Exception as exc:
                self.on_finished(job, None, _describe(exc))
                continue
            ok.append(job)
        return ok

    def _pass(self, active: list[RequestJob]) -> None:
        split = self.ctx.split
        last = split.num_layers - 1
        und = [b for job in active for b in job.branches if b.needs_und]
        gen = [b for job in active for b in job.branches]
        for index in range(split.num_layers):
            if und:
                layer = self.weights.layer(index, UND)
                for branch in und:
                    split.und_layer(layer, branch, is_last=index == last)
                self.und_runs += len(und)
            layer = self.weights.layer(index, GEN)
            for branch in gen:
                split.gen_layer(layer, branch, index)
        self.passes += 1

    def _finish(self, active: list[RequestJob]) -> list[RequestJob]:
        still = []
        for job in active:
            try:
                job.finish_step()
                if not job.done:
                    still.append(job)
                    continue
                result = job.decode()
            except Exception as exc:
                self.on_finished(job, None, _describe(exc))
                continue
            self.on_finished(job, result, None)
        return still


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
