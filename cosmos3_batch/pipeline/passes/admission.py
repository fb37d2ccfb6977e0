"""Admission on a UND pass: the requests a rank takes into its slots become jobs of their kind, prepared
(inputs read, conditioning encoded: with the VAE team when there is one), and agreed on inside an `--sp`
group. A request that fails to prepare fails alone; a broken VAE team ends the job."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cosmos3_batch.parallel.vae_group import GroupBroken
from cosmos3_batch.pipeline.finish.vae_team import VaeTeam, agree_inputs
from cosmos3_batch.pipeline.kinds.chained import UpsampleJob
from cosmos3_batch.pipeline.kinds.context import ModelContext
from cosmos3_batch.pipeline.kinds.denoise import RequestJob
from cosmos3_batch.pipeline.kinds.reason import ReasonJob
from cosmos3_batch.pipeline.kinds.step_cache.cache import StepCache
from cosmos3_batch.pipeline.kinds.transfer.chain import TransferJob
from cosmos3_batch.pipeline.kinds.transfer.inputs import AheadOfAdmission

if TYPE_CHECKING:
    from cosmos3_batch.parallel.seq_group import SeqGroup
    from cosmos3_batch.plan.cache import SeaSettings
    from cosmos3_batch.requests.parse import Request


def job_class(request: Request) -> type[RequestJob]:
    """The state machine a request runs as, by its kind: the reasoner's decode, Transfer's chunk chain, or the
    one-segment job. A new kind adds its class here; the runner asks every kind the same questions."""
    if request.upsample is not None and request.upsampled is None:  # its prompt is rewritten first
        return UpsampleJob
    if request.reason is not None:
        return ReasonJob
    return TransferJob if request.transfer is not None else RequestJob


def has_gen_work(request: Request) -> bool:
    """Whether a request admitted on a UND pass runs GEN branches on it: every kind but a reasoner's. One to
    be upsampled counts too: admission may find its prompt recorded, or exempt (`Chains.resolve`, a read of
    its record), and generate at once; the exchange that decides the pass's fetches comes before admission."""
    return job_class(request) is not ReasonJob


def takes_reason_slot(item: Request | RequestJob) -> bool:
    """A request (queued) or its job (prefilled ahead, active) that takes a reasoner slot (plan/prefill.py
    RankSlots, --max-reason-active): a reasoner request. The reasoner stages chained to a generation request
    (its upsampling, its captions) ride that request's generation slot."""
    request = item.request if isinstance(item, RequestJob) else item
    return job_class(request) is ReasonJob


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass
class Admission:
    ctx: ModelContext
    und_cache: bool
    sp: SeqGroup | None
    chunk_gap: int  # --chunk-gap-passes: what a Transfer chain sits out at each chunk boundary
    hand_off: Callable  # the finisher's: a Transfer chunk boundary runs on its thread
    leads: bool  # this rank speaks for its --sp group (it keeps a chain's output)
    cache: SeaSettings | None  # --cache sea
    team: VaeTeam | None = None  # --vae-patch-parallel-size: admission's encodes are the group's
    ahead: AheadOfAdmission | None = None  # Transfer requests' host inputs, prepared off the loop
    resolve: Callable[[Request], Request] | None = None  # passes/chains.py: an upsampled prompt recorded

    def admit(self, requests: list[Request]) -> tuple[list[RequestJob], list[tuple[RequestJob, str]]]:
        """(the jobs admitted, the (job, error) of those that failed to prepare)."""
        if self.resolve is not None:
            requests = [self.resolve(request) for request in requests]
        jobs = [
            job_class(request)(self.ctx, request, und_cache=self.und_cache, sp=self.sp)
            for request in requests
        ]
        for job in jobs:
            if isinstance(job, TransferJob):  # its chunk boundaries: on the finisher's thread, a fixed gap
                job.gap, job.hand_off, job.keeps_output = self.chunk_gap, self.hand_off, self.leads
                job.ahead = None if self.ahead is None else self.ahead.take(job.request)
        errors = self._prepare(jobs)
        admitted, failed = [], []
        for job, error in zip(jobs, errors, strict=True):
            if error is None:
                if self.cache is not None and not job.owns_parts:  # a step cache gates GEN branches only
                    job.cache = StepCache(self.cache, job, self.ctx.sampler.distilled)
                admitted.append(job)
            else:
                failed.append((job, error))
        return admitted, failed

    def _prepare(self, jobs: list[RequestJob]) -> list[str | None]:
        team = self.team
        if team is not None:  # the group encodes together: agree on the files first
            agree_inputs(jobs, self.sp)
        errors = []
        for job in jobs:
            try:
                if team is None:
                    job.prepare()
                else:  # an error before this rank's part in the group's encode ends the job
                    team.prepare(job)
                errors.append(None)
            except GroupBroken:  # the group's collectives would misalign: end the job
                raise
            except Exception as exc:  # a bad request must not take the job down
                errors.append(describe(exc))
        if self.sp is not None and jobs:
            # A request that failed to prepare on one rank of the group (a read error, out of memory) is
            # dropped on all of them: the group's all-to-alls must carry the same requests.
            agreed = self.sp.agree([error is None for error in errors])
            errors = [
                error if error is not None or ok else "failed to prepare on another rank of its --sp group"
                for error, ok in zip(errors, agreed, strict=True)
            ]
        return errors
