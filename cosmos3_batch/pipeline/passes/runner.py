"""The pass loop (DESIGN.md §4): collectives that do not depend on the requests.

Every pass, on every rank:
1. fill free slots from the requests prefilled ahead, then one small all-reduce on a host (gloo) group:
   [active, starved slots, overdue, pending, needs-UND, finished, stop]; nothing active or pending
   anywhere, or a stop flag from any rank (SIGINT/SIGTERM), ends the run on every rank at the same pass;
2. from those sums alone, every rank decides whether this is a UND (prefill) pass (`plan/prefill.py`); on
   one, each rank admits requests into its free slots and prefills a few more ahead;
3. walk layers 0..L-1 fetching the same parts in the same order (UND on UND passes, GEN when some rank
   has GEN work: `plan/prefill.py gen_pass`, from the sums too): a rank with nothing to compute only takes
   part in the transfers; UND halves run for the branches being prefilled, GEN halves for the active ones;
4. finish each request's step on its own (head, CFG, its scheduler); finished ones go to the finisher
   thread (decode + write off the loop).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from cosmos3_batch.engine.transport import Counters
from cosmos3_batch.io.metrics import PassRecord
from cosmos3_batch.model.batched import batch_by_default
from cosmos3_batch.model.cosmos3 import GEN, UND
from cosmos3_batch.parallel.exit_codes import ExitCode
from cosmos3_batch.parallel.stop import JobFault, StopRequest
from cosmos3_batch.pipeline.finish.finisher import Finisher
from cosmos3_batch.pipeline.kinds.context import ModelContext
from cosmos3_batch.pipeline.kinds.denoise import RequestJob, Result
from cosmos3_batch.pipeline.kinds.step_cache.cache import gate_rank, tally
from cosmos3_batch.pipeline.kinds.transfer.chain import rejoin
from cosmos3_batch.pipeline.kinds.transfer.inputs import AheadOfAdmission
from cosmos3_batch.pipeline.passes.admission import Admission, describe, has_gen_work, takes_reason_slot
from cosmos3_batch.pipeline.passes.apply import PartApplier
from cosmos3_batch.pipeline.passes.chains import Chains, poll_captions
from cosmos3_batch.pipeline.passes.exchange import Exchanged, Figures, PassSync
from cosmos3_batch.pipeline.passes.weights import LayerWeights
from cosmos3_batch.plan.prefill import GEN_POOL, PrefillRule, RankSlots, SlotReport, gen_pass, und_pass

if TYPE_CHECKING:
    from cosmos3_batch.io.upsampled import UpsampleStore
    from cosmos3_batch.parallel.seq_group import SeqGroup
    from cosmos3_batch.plan.cache import SeaSettings
    from cosmos3_batch.requests.parse import Request

# on_finished(job, result, error): exactly one of result / error is set.
FinishedCallback = Callable[[RequestJob, Result | None, str | None], None]


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
        rule: PrefillRule | None = None,
        batch_branches: bool | None = None,
        sp: SeqGroup | None = None,
        watch: Callable[[], str | None] | None = None,
        max_batch_rows: int | None = None,
        on_exchange: Callable[[Exchanged], None] | None = None,
        failures: Callable[[], int] | None = None,
        cache: SeaSettings | None = None,
        upsampled: UpsampleStore | None = None,
        text_check: Callable[[str], str | None] | None = None,
        max_reason_active: int | None = None,
    ):
        # Two pools of slots (plan/prefill.py RankSlots): generation requests, and reasoner requests (None: as
        # many as --max-active).
        self.max_active, self.max_reason_active = max_active, max_reason_active or max_active
        if min(self.max_active, self.max_reason_active) < 1:
            raise ValueError(f"--max-active and --max-reason-active must be >= 1, got {self.max_active}, "
                             f"{self.max_reason_active}")  # fmt: skip
        self.ctx = ctx
        self.weights = weights
        self.on_finished = on_finished
        self.sync = sync if sync is not None else PassSync()
        self.on_progress = on_progress
        self.on_exchange = on_exchange  # the live figures (rank 0's monitor): every exchange's sums
        self.failures = failures  # requests failed on this rank so far (the writer's count: write errors too)
        self.und_cache = und_cache
        self.stop = stop if stop is not None else StopRequest()
        self.watch = watch  # CheckpointWatch.changed: what changed in the checkpoint's files, if anything
        rule = rule if rule is not None else PrefillRule()
        # Without the UND cache every step recomputes UND anyway: prefilling ahead would only hold memory.
        self.rule = rule if und_cache else replace(rule, lookahead=0)
        self.passes = 0
        self.und_passes = 0  # passes that fetched UND parts (some rank admitted a request)
        self.cache = cache  # --cache sea (kinds/step_cache/cache.py): a branch may reuse instead of computing
        self.skipped_passes = 0  # passes with no GEN work (every branch reused) and no UND: nothing fetched
        self.gen_passes = 0  # passes that fetched GEN parts (some rank had a branch to run through them)
        self.forwards = [0, 0]  # branch forwards of its requests: [ran the layers, reused] (--sp: once)
        self.reason_active_sum = 0  # requests in reasoner slots, summed over the passes (the occupancy's)
        self.pass_s = 0.0  # wall time walking the layers (fetch waits + compute), summed over passes
        if batch_branches is None:  # batched where it keeps the bits (nowhere on CPU), else per branch
            batch_branches = batch_by_default(ctx.device, ctx.split.dtype)
        # --sp: the ranks of a group run the same requests in lockstep; the group's first rank speaks for
        # it in the exchange and alone decodes, writes and reports. A compute error there would leave the
        # others waiting in an all-to-all, so it ends the job (as a dead rank does) instead of one request.
        self.sp = sp
        self.leads = sp is None or sp.leads
        # --vae-patch-parallel-size: the group's first P ranks decode each finished request together.
        self.team = ctx.vae_team
        self.decodes = self.team is not None and self.team.decodes
        self.finisher = Finisher(self._report, ctx.device)
        self._trace_groups()
        # --sp with --cache sea: every member gates with its lead's distances (kinds/step_cache/cache.py).
        self._share = sp.share_lead if sp is not None and cache is not None else None
        # --max-batch-rows: a batched group's transient (MLP gate/up/product above all) grows with its rows.
        # Its und_runs / gen_runs count the UND / GEN half applications (layer x branch).
        self.apply = PartApplier(ctx.split, batch_branches, max_batch_rows, strict=sp is not None)
        self.totals = Counters()
        self.started = time.perf_counter()  # the timeline's zero
        self.timeline: list[PassRecord] = []  # one small record per pass, for the run report
        self.interrupted = False  # the run left the loop on a stop request
        self.abandoned: list[RequestJob] = []  # mid-denoise when the run stopped: redone by the next run
        self.not_started: list[Request] = []  # still queued when the run stopped
        self._unsubmitted: list[RequestJob] = []  # finished from a changed checkpoint: never written
        self._reported = 0  # requests reported on this rank since the last exchange (finisher thread)
        self._failed = [0, 0]  # requests failed on this rank: so far, and so far as the exchange has told
        self._moved = Counters()  # the last pass's counters, until the next exchange carries them
        self._count_lock = threading.Lock()  # held only to bump or take that count, never during a write
        self.ahead = AheadOfAdmission(ctx.helper, ctx.split.dtype)  # Transfer inputs, read off the loop
        gap = self.rule.chunk_gap
        # Reasoner stages chained to generation (passes/chains.py); `_requeue`: just upsampled, to generate.
        self.chains, self._requeue = Chains(upsampled, self.finisher, gap, text_check), []
        self.admission = Admission(ctx, self.und_cache, sp, gap, self.finisher.hand_off, self.leads, cache,
                                   self.team, self.ahead, self.chains.resolve)  # fmt: skip

    def _trace_groups(self) -> None:
        """The groups' collectives go into the pass trace, and their waits are marked for rank 0's monitor."""
        if self.sp is not None:
            self.sp.note, self.sp.mark = self.sync.note, self.sync.waiting
        if self.team is not None:  # the encodes' broadcasts, which every rank of the group issues
            self.team.encoding.note, self.team.encoding.mark = self.sync.note, self.sync.waiting
            if self.team.decoding is not None:  # the finisher's waits: its own mark
                self.team.decoding.mark = self.finisher.mark
        self.sync.marks.append(self.finisher.mark)  # its decodes' device reads, its group messages

    @torch.no_grad()
    def run(self, requests: Iterable[Request]) -> None:
        try:
            self._loop(deque(requests))
            # The last passes' device times (CUDA events) complete after their end_pass: read them now, so
            # the run's totals hold every pass. Not after a failure: a dead peer's gather never completes.
            self.totals.add(self.weights.drain())
        finally:
            self.ahead.close()
            # Also when a peer died mid-run: requests already denoised here still get decoded and written.
            self.finisher.close()
        self.finisher.check()  # a decode after the last pass met a lost peer: not a clean end
        if self.team is not None:
            self.team.check()

    def _loop(self, queue: deque) -> None:
        slots = RankSlots(queue, self.max_active, self.rule, self.max_reason_active, takes_reason_slot)
        active: list[RequestJob] = []
        groups = self.sync.world_size // (1 if self.sp is None else self.sp.size)
        world_slots = groups * self.max_active  # an --sp group's slots count once
        reason_slots = groups * self.max_reason_active
        while True:
            if self.team is not None:
                self.team.check()  # a group decode broke on this rank: end the job (finish/vae_team.py)
            self.finisher.check()  # a decode met a lost peer (its device read): end the job as one
            active += slots.take_ready(_pools(active))  # prefilled earlier: no UND needed for these
            self.ahead.look(slots.queues[GEN_POOL])  # the next Transfer requests' files, read off the loop
            with self.sync.host_read("a Transfer chunk boundary's result"):
                active, failed = rejoin(active, self.sp)  # Transfer chains back from a chunk boundary
            with self.sync.host_read("a caption's decoded frames"):
                failed += poll_captions(active)  # kinds/chained.py: frames back from the finisher's decode
            for job, error in failed:
                self._fail(job, error)
            with self.sync.host_read("the step cache's distances"):  # before any layer: what runs this pass
                computing = gate_rank(active, self._share)
            world = self._exchange(active, slots, computing)
            if world.stop:
                self._abandon(active, slots)
                return
            if world.active == 0 and world.pending == 0:
                return
            # The same decision on every rank: it reads only the all-reduced sums.
            reason = (reason_slots, world.reason_starved)
            und = world.und or und_pass(
                self.rule, world_slots, world.active, world.starved, world.overdue, reason
            )
            prefill: list[RequestJob] = []
            if und:
                now, later = slots.admissions(_pools(active))
                admitted = self._admit(now)
                # Only the requests just admitted (at their first step: forced to compute): the others were
                # gated for this step before the exchange, and a second gate would count a reuse twice.
                with self.sync.host_read("the step cache's distances"):
                    gate_rank(admitted, self._share)
                active += admitted
                prefill = self._admit(later)
            # The same decision on every rank (sums only): GEN parts only if some branch anywhere runs them.
            gen = gen_pass(und, world.computing, world.admits_gen)
            if und or gen:  # start fetching the first part now: the transfer overlaps the embedding
                self.weights.begin_pass(und, gen)
            active = self._begin(active)
            self._pass(active, und, gen, prefill)
            slots.ready.extend(self._drop_failed(prefill))
            # The pass may have read changed bytes: its steps are taken (an --sp group's collectives stay
            # aligned) but nothing it finished is submitted; the next exchange stops every rank.
            submit = not self._checkpoint_changed()
            if self.team is not None and any(job.last_step for job in active):
                submit = self.sp.agree([submit])[0]  # every decoding rank submits the same requests
            active = self._finish(active, submit=submit)
            slots.requeue(self._requeue)  # upsampled: generated next, on this rank
            self._requeue.clear()

    def _exchange(self, active: list[RequestJob], slots: RankSlots, computing: int) -> Exchanged:
        """The pass's one all-reduce: this rank's state and live figures in, the world's sums back."""
        report = slots.report(_pools(active))
        local_und = any(job.needs_und for job in active)  # a reasoner decoding; the --no-und-cache ablation
        admits = sum(map(has_gen_work, slots.admitting(_pools(active))))  # if the pass is a UND pass
        with self._count_lock:
            mine, self._reported = self._reported, 0
            failed, self._failed[1] = self._failed[0] - self._failed[1], self._failed[0]
        moved, self._moved = self._moved, Counters()
        figures = Figures(failed, moved.h2d_bytes + moved.gathered_bytes, moved.stall_s)
        stop = self.stop.requested
        if self.leads:
            world = self.sync.exchange(len(active), report, local_und, mine, stop, figures, computing, admits)
        else:  # the group's state is counted once, by its first rank; a signal counts from any rank
            figures = Figures(0, figures.weight_bytes, figures.stall_s)  # its bytes are its own
            world = self.sync.exchange(0, SlotReport(0, 0, 0), False, 0, stop, figures)
        if self.on_exchange is not None:
            self.on_exchange(world)
        if self.on_progress is not None and world.finished > mine:
            self.on_progress(world.finished - mine)  # our own were counted as they were written
        return world

    def _abandon(self, active: list[RequestJob], slots: RankSlots) -> None:
        """Some rank stopped: leave the loop, with what was in flight and what never started on record."""
        self.interrupted = True
        for job in active:
            job.abandon()
        if self.leads:  # a group's requests are on record once
            # Prefilled-ahead requests never took a step: like the queued ones, not started.
            self.abandoned = active + self._unsubmitted
            self.not_started = [job.request for job in slots.ready] + slots.waiting()

    def _checkpoint_changed(self) -> bool:
        """After a pass, before anything it computed is submitted: are the checkpoint's files as loaded?
        A change stops the job at the next exchange (exit 1), on every rank. Under --sp only the group's
        first rank submits, and its stat comes after every group rank's reads of the pass (they reached
        it through the all-to-alls), so it sees any change those reads saw."""
        if self.watch is None or (change := self.watch()) is None:
            return False
        advice = "replace checkpoints by rename, never in place"
        message = f"{change}; nothing computed from it is written ({advice})"
        self.stop.fail(JobFault(ExitCode.FAILED, "checkpoint", message))
        return True

    def _report(self, job: RequestJob, result: Result | None, error: str | None) -> None:
        # On the finisher thread only (it serializes reports): the loop never waits for a write.
        self.on_finished(job, result, error)
        with self._count_lock:
            self._reported += 1
            mine = self._failed[0] + (error is not None)
            self._failed[0] = self.failures() if self.failures is not None else mine
        if self.on_progress is not None:
            self.on_progress(1)

    def _admit(self, requests: list[Request]) -> list[RequestJob]:
        admitted, failed = self.admission.admit(requests)
        for job, error in failed:
            self._fail(job, error)
        return admitted

    def _drop_failed(self, jobs: list[RequestJob]) -> list[RequestJob]:
        ok = []
        for job in jobs:
            if job.error is not None:
                self._fail(job, job.error)
            else:
                ok.append(job)
        return ok

    def _begin(self, active: list[RequestJob]) -> list[RequestJob]:
        ok = []
        for job in active:
            try:
                job.begin_step()
            except Exception as exc:
                if self.sp is not None:
                    raise
                self.finisher.fail(job, describe(exc))
                continue
            ok.append(job)
        return ok

    def _pass(self, active: list[RequestJob], und_flag: bool, gen: bool, prefill: list[RequestJob]) -> None:
        """Walk the layers: UND halves (if fetched) for every branch still to prefill, the active ones and
        those prefilled ahead; GEN halves (if fetched) for the branches that compute (step_cache/cache.py
        computing). Neither (`skip`): no branch computes anywhere, no layer is walked, fetched or gathered."""
        split, weights = self.ctx.split, self.weights
        started = time.perf_counter()
        prefilling = active + prefill
        skip = not (und_flag or gen)
        for index in range(0 if skip else split.num_layers):
            if und_flag:
                self.sync.note_world(f"part:{index}.{UND}")
                self.apply(prefilling, weights.layer(index, UND), index, UND)
            if gen:
                self.sync.note_world(f"part:{index}.{GEN}")
                self.apply(active, weights.layer(index, GEN), index, GEN)
        counters = Counters() if skip else weights.end_pass()
        ran = tally(active)
        self.reason_active_sum += _pools(active)[1]
        if self.leads:
            self.forwards = [a + b for a, b in zip(self.forwards, ran, strict=True)]
        self._moved = counters
        ended = time.perf_counter()
        self.pass_s += ended - started
        self._account(prefilling, counters)
        moved = counters.h2d_bytes + counters.gathered_bytes
        self.timeline.append(PassRecord(self.passes, started - self.started, ended - started, und_flag,
                                        len(active), counters.stall_s, moved, skip, ran[0], gen))  # fmt: skip
        self.passes += 1
        self.und_passes += und_flag
        self.gen_passes += gen
        self.skipped_passes += skip

    def _account(self, riders: list[RequestJob], counters: Counters) -> None:
        self.totals.add(counters)
        # A pass's weight traffic is shared by the requests that rode on it (prefilled ones included);
        # with --sp every rank of the group moved it, and the group's first rank writes the row.
        ranks = 1 if self.sp is None else self.sp.size
        for job in riders:
            job.weight_bytes += ranks * (counters.h2d_bytes + counters.gathered_bytes) / len(riders)
            job.stall_s += counters.stall_s / len(riders)

    def _finish(self, active: list[RequestJob], submit: bool = True) -> list[RequestJob]:
        """Each job's step after the pass; `submit=False` (a changed checkpoint): the steps are still taken,
        so that an --sp group's collectives stay aligned, but nothing is submitted or failed: every job
        becomes abandoned at the stop that follows."""
        still = []
        for job in active:
            error = job.error
            if error is None:
                try:
                    job.finish_step()
                except Exception as exc:
                    if self.sp is not None:
                        raise
                    error = describe(exc)
            if not submit:
                self._unsubmitted.append(job)
            elif error is not None:
                self._fail(job, error)
            elif job.done:
                # Only the latents are needed from here: drop the UND caches and GEN streams now, so
                # device memory does not grow with the decode backlog.
                job.branches = []
                if (after := self.chains.after(job)).chained:  # a reasoner stage before or after it
                    if after.error is not None:
                        self._fail(job, after.error)
                    self._requeue += [] if after.requeue is None else [after.requeue]
                    still += [] if after.job is None else [after.job]
                elif self.leads:
                    self.finisher.submit(job)  # decode + write off the loop: the other ranks need not wait
                elif self.decodes:
                    self.finisher.submit(job, write=False)  # decodes with the writer (vae_team.py)
            else:
                still.append(job)
        return still

    def _fail(self, job: RequestJob, error: str) -> None:
        if self.leads:
            self.finisher.fail(job, error)


def _pools(active: list[RequestJob]) -> tuple[int, int]:
    """A rank's active jobs as (in generation slots, in reasoner slots): what RankSlots counts."""
    reasoning = sum(map(takes_reason_slot, active))
    return len(active) - reasoning, reasoning
