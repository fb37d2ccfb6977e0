"""The runner's side of the reasoner stages chained to generation (DESIGN.md §22, kinds/chained.py): what a
request is admitted as, and what a finished job leads to. All of it is this rank's own: no collective depends
on it (a chain's passes are its jobs' passes, counted in the exchange as any job's).

- At admission (`resolve`): a request asking for upsampling whose prompt is already recorded (a rerun)
  generates from the recorded prompt; one that its mode or its prompt exempts keeps its prompt, recorded why;
  the rest become an `UpsampleJob`.
- After a job's last step (`after`): an upsampled prompt is recorded on disk, then its generation request
  goes to the head of this rank's queue (or it fails, with the reason); a generation request with captions
  or a score becomes a `CaptionJob` in its slot, its frames decoded on the finisher's thread meanwhile; a
  finished `CaptionJob` hands the request's result, with its texts, to the finisher.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from cosmos3_batch.pipeline.finish.blocked import Blocked
from cosmos3_batch.pipeline.kinds.chained import CaptionJob, UpsampleJob
from cosmos3_batch.requests.chain import skip_reason

if TYPE_CHECKING:
    from cosmos3_batch.io.upsampled import UpsampleStore
    from cosmos3_batch.pipeline.finish.finisher import Finisher
    from cosmos3_batch.pipeline.kinds.denoise import RequestJob
    from cosmos3_batch.requests.parse import Request


@dataclass
class Next:
    """What a finished job leads to: at most one of these set (none: the finisher decodes and writes it)."""

    requeue: Request | None = None  # generate this next, on this rank
    error: str | None = None  # the request fails
    job: RequestJob | None = None  # takes the finished job's slot
    chained: bool = False  # handled here (even if nothing else is set)


class Chains:
    def __init__(
        self,
        store: UpsampleStore | None,
        finisher: Finisher,
        gap: int,
        text_check: Callable[[str], str | None] | None = None,
    ):
        self.store = store  # None: nothing is recorded (unit tests of the loop alone)
        self.finisher = finisher
        self.gap = gap
        # The text guardrail (finish/guardrail.py Guardrails.text) where the job runs them: an upsampled
        # prompt is a prompt the reference would be handed, so it is checked before it is generated.
        self.text_check = text_check

    def resolve(self, r: Request) -> Request:
        """The request as admitted: upsampled already (recorded, or exempt), else as it is."""
        if r.upsample is None or r.upsampled is not None:
            return r
        if (why := skip_reason(r.prompt, r.action is not None)) is not None:
            return replace(r, prompt_original=r.prompt, upsampled={"status": "skipped", "reason": why})
        if self.store is not None and (record := self.store.read(r.id, r.content_hash())) is not None:
            kept = {
                k: v for k, v in record.items() if k not in ("id", "request_hash", "model_digest", "prompt")
            }
            return replace(
                r, prompt=record["prompt"], prompt_original=r.prompt, upsampled={**kept, "reused": True}
            )
        return r

    def _unsafe(self, request: Request) -> str | None:
        """Why the guardrail blocks this request's upsampled prompt (None: it passes, or is the file's own,
        checked before the first pass, or the job runs no guardrails)."""
        if self.text_check is None or request.upsampled.get("status") != "upsampled":
            return None
        return self.text_check(request.prompt)

    @staticmethod
    def upsamples(r: Request) -> bool:
        return r.upsample is not None and r.upsampled is None

    def after(self, job: RequestJob) -> Next:
        if isinstance(job, UpsampleJob):
            request, error = job.generation()
            if request is None:
                return Next(error=error, chained=True)
            if (why := self._unsafe(request)) is not None:  # recorded as blocked, in order with the writes
                self.finisher.done(job, Blocked(why, "upsampled prompt"))
                return Next(chained=True)
            if self.store is not None:  # before it generates: a kill from here on reuses this prompt
                rid, original = request.id, request.prompt_original
                self.store.write(rid, request.content_hash(), original, request.prompt, request.upsampled)
            return Next(requeue=request, chained=True)
        if isinstance(job, CaptionJob):
            self.finisher.done(*job.report())
            return Next(chained=True)
        if job.request.captions is not None and job.request.reason is None:
            return Next(job=CaptionJob(job, self.finisher.hand_off(job.decode), self.gap), chained=True)
        return Next()


def poll_captions(active: list[RequestJob]) -> list[tuple[RequestJob, str]]:
    """Caption jobs waiting for their frames take them if ready (kinds/chained.py CaptionJob.poll); the
    (job, error) of those whose decode or first prefill failed, dropped from `active`."""
    failed = []
    for job in list(active):
        if isinstance(job, CaptionJob) and job.waiting:
            try:
                job.poll()
            except Exception as exc:
                active.remove(job)
                failed.append((job, f"{type(exc).__name__}: {exc}"))
    return failed
