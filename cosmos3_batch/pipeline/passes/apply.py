"""One fetched layer part applied to a rank's branches: one branch at a time, or with rows batched.

Per branch is what the reference computes and the default on CPU, where it is the only bit-exact way
(`model/batched.py` says why: CPU GEMMs round a row differently when the row count changes). Batched
(`--batch-branches on`, the default off CPU) runs each group's token-wise ops as one GEMM per projection.
Either way a request whose compute fails is marked failed and skipped, and the rank keeps walking the
layers with the others, so its collectives stay aligned.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cosmos3_batch.model.batched import gen_layer_batched, row_groups, und_layer_batched
from cosmos3_batch.model.cosmos3 import GEN, BranchSeq, Cosmos3Split
from cosmos3_batch.pipeline.kinds.step_cache.cache import computing

if TYPE_CHECKING:
    from cosmos3_batch.pipeline.kinds.denoise import RequestJob


class PartApplier:
    def __init__(self, split: Cosmos3Split, batched: bool, max_rows: int | None = None, strict: bool = False):
        self.split = split
        self.batched = batched
        # strict (--sp): a compute error is raised, not kept per request, since the group's other ranks are
        # waiting for this rank's all-to-alls of that request.
        self.strict = strict
        self.max_rows = max_rows  # rows per batched group; None: all of a rank's branches together
        self.und_runs = 0  # UND half applications (layer x branch): once per branch per layer, ever
        self.gen_runs = 0  # GEN half applications (layer x branch): a request's forwards x layers

    def __call__(self, jobs: list[RequestJob], layer: torch.nn.Module, index: int, part: str) -> None:
        if any(job.owns_parts for job in jobs):  # kinds that run a part themselves (kinds/reason.py)
            for job in jobs:
                if job.owns_parts:
                    self._own(job, layer, index, part)
            jobs = [job for job in jobs if not job.owns_parts]
        fp8 = self.split.fp8
        if fp8 is None:
            return self._apply(jobs, layer, index, part)
        # FP8: requests at different steps may need different math (model/fp8.py), and a batched group is
        # one GEMM per projection: apply the part once per precision, to the requests that want it.
        by_precision: dict[bool, list[RequestJob]] = {}
        for job in jobs:
            wants = fp8.wants_high_precision(job.step_index, len(job.timesteps), part == GEN)
            by_precision.setdefault(wants, []).append(job)
        for high_precision, group in by_precision.items():
            fp8.high_precision = high_precision
            # --sp: a GEN half's rows are spread over the group, so W8A8's per-tensor amax is reduced over
            # it (the UND half runs whole on every rank).
            sp = getattr(group[0], "sp", None) if part == GEN else None
            fp8.amax_reduce = sp.max_reduce if sp is not None else None
            try:
                self._apply(group, layer, index, part)
            finally:
                fp8.amax_reduce = None

    def _apply(self, jobs: list[RequestJob], layer: torch.nn.Module, index: int, part: str) -> None:
        is_last = index == self.split.num_layers - 1
        # GEN: the branches that run the stack at this step (step_cache.computing: the step's branches,
        # plan/branches.py, less those that reuse, which leave the batch too); UND: texts still to prefill.
        pairs = [
            (job, branch)
            for job in jobs
            if job.error is None
            for branch in (computing(job) if part == GEN else job.branches)
            if part == GEN or branch.needs_und
        ]
        if not self.batched:
            for job, branch in pairs:
                self._one(job, branch, layer, index, part, is_last)
            return
        rows = [_rows(branch, part) for _, branch in pairs]
        owner = {id(branch): job for job, branch in pairs}
        for group in row_groups([branch for _, branch in pairs], rows, self.max_rows):
            group = [b for b in group if owner[id(b)].error is None]
            try:
                if part == GEN:
                    gen_layer_batched(self.split, layer, group, index)
                    self.gen_runs += len(group)
                else:
                    und_layer_batched(self.split, layer, group, is_last)
                    self.und_runs += len(group)
            except Exception:
                if self.strict:
                    raise
                # The batched halves write nothing until all is computed: redo the group branch by branch,
                # so only the request that really fails is marked failed.
                for branch in group:
                    self._one(owner[id(branch)], branch, layer, index, part, is_last)

    def _own(self, job: RequestJob, layer: torch.nn.Module, index: int, part: str) -> None:
        if job.error is not None:
            return
        try:
            job.apply_part(layer, index, part)
        except Exception as exc:
            if self.strict:
                raise
            job.error = f"{type(exc).__name__}: {exc}"

    def _one(self, job: RequestJob, branch: BranchSeq, layer, index: int, part: str, is_last: bool) -> None:
        if job.error is not None:
            return
        try:
            if part == GEN:
                self.split.gen_layer(layer, branch, index)
                self.gen_runs += 1
            else:
                self.split.und_layer(layer, branch, is_last)
                self.und_runs += 1
        except Exception as exc:
            if self.strict:
                raise
            job.error = f"{type(exc).__name__}: {exc}"


def _rows(branch: BranchSeq, part: str) -> int:
    """The rows the row budget counts: a --sp branch's whole GEN sequence, not this rank's share, so every
    rank of the group cuts its branches into the same groups (W8A8's amax reductions run per group)."""
    if part == GEN and branch.shard is not None:
        return sum(branch.shard.rows)
    hidden = branch.gen_hidden if part == GEN else branch.und_hidden
    return int(hidden.shape[0])
