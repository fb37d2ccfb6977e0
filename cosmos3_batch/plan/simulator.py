"""The pass simulator (DESIGN.md §4): the pass protocol replayed without a model, torch-free.

Same schedule (the caller passes `schedule.assign`'s queues), same admission and prefill rule (the
`prefill` module the runner uses), same per-request step and branch counts, same part byte sizes. Its
passes, UND passes and bytes equal a real run's counters exactly when no request fails (a test holds
this at world sizes 1-4), so `plan` can size a 64-GPU job from a laptop.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, replace

from cosmos3_batch.plan.prefill import PrefillRule, RankSlots, gen_pass, und_pass


@dataclass(frozen=True)
class SimRequest:
    id: str
    steps: int
    branches: int = 1  # 2 with classifier-free guidance
    # --cache sea, replayed: per step "C" when some branch ran the decoder stack, "R" when every branch
    # reused (plan/cache.step_decisions of a sidecar's decisions); "" = every step computes.
    decisions: str = ""
    # A reasoner request (DESIGN.md §21): every pass it is active on is a UND pass (its needs-UND flag); its
    # steps are its generated tokens (planned: max_new_tokens; EOS may end it sooner). It has no GEN work.
    decodes: bool = False
    # Counted as GEN work on the pass that admits it although it decodes: a request to be upsampled, which
    # the runner cannot tell from a generation request before admission reads its record (runner.py).
    gen_at_admission: bool = False

    def __post_init__(self) -> None:
        assert not self.decisions or len(self.decisions) == self.steps, (self.id, self.decisions)


@dataclass(frozen=True)
class PartBytes:
    """Weight bytes one rank moves (host->device + gathered) per pass for all GEN / all UND parts."""

    gen: int = 0
    und: int = 0


@dataclass
class Simulation:
    passes: int
    und_passes: int
    outputs: int
    occupancy: float  # mean share of slots active over all passes and ranks
    bytes_per_rank: int  # weight bytes each rank moves over the run
    bytes_per_output: float  # all ranks' weight bytes / outputs
    und_byte_share: float  # share of the weight bytes that were UND halves
    und_sequence_runs: int  # branches prefilled (each runs the UND half of every layer once)
    skipped_passes: int = 0  # passes that fetched nothing: no GEN work (--cache sea: all reused) and no UND
    decode_passes: int = 0  # passes on which some reasoner request was active (each a UND pass)
    decode_und_bytes: int = 0  # all ranks' UND weight bytes moved on those passes
    gen_passes: int = 0  # passes that fetched the GEN parts: some request computed its step's GEN branches

    def to_dict(self) -> dict:
        return asdict(self)


class _Totals:
    """The per-pass sums of `RankSlots.report`, kept as running totals (see `simulate`): requests active and
    slots starved, per rank and over all ranks; the first pass of each current starvation; the ranks whose
    requests take their last step on each pass; and the active requests summed over the passes."""

    def __init__(self, world: int, max_active: int):
        self.max_active = max_active
        self.active = [0] * world  # requests active per rank
        self.starved = [0] * world  # free slots with nothing prefilled while requests are queued, per rank
        self.total_active = self.total_starved = self.active_sum = 0
        self.finishing: dict[int, list[int]] = {}  # pass -> ranks of requests taking their last step in it
        self.starving_since: deque[int] = deque()  # first pass of each current starvation, oldest first
        self.reusing: dict[int, int] = {}  # pass -> active requests all of whose branches reuse on it
        self.decoding = 0  # active reasoner requests: while any, every pass fetches the UND parts
        self.decoders: dict[int, int] = {}  # pass -> reasoner requests taking their last step in it

    def activate(self, rank: int, jobs: list[SimRequest], now: int) -> None:
        for r in jobs:
            self.finishing.setdefault(now + r.steps - 1, []).append(rank)
            if r.decodes:
                self.decoding += 1
                self.decoders[now + r.steps - 1] = self.decoders.get(now + r.steps - 1, 0) + 1
            self.active_sum += r.steps  # active on this pass and each of its remaining steps
            for step, decision in enumerate(r.decisions):  # step i is taken on pass now + i
                if decision == "R":
                    self.reusing[now + step] = self.reusing.get(now + step, 0) + 1
        self.active[rank] += len(jobs)
        self.total_active += len(jobs)

    def settle(self, rank: int, queued: bool, now: int) -> None:
        """After a rank's free slots took what was ready: they starve if requests are still queued."""
        starved = self.max_active - self.active[rank] if queued else 0
        if starved and not self.starved[rank]:
            self.starving_since.append(now)
        self.total_starved += starved - self.starved[rank]
        self.starved[rank] = starved

    def overdue(self, now: int, max_wait: int) -> int:
        """1 if the oldest starved slot, waiting `now - since + 1` passes, is past max_wait."""
        return int(bool(self.starving_since) and now - self.starving_since[0] + 1 > max_wait)

    def admit(self, slots: list[RankSlots], now: int) -> tuple[int, int, int]:
        """A UND pass: every rank admits into its free slots (the rest of the prefilled become ready), so
        none starves after it. Returns (requests admitted now, branches prefilled, of the admitted those with
        GEN work on this pass)."""
        admitted = branches = generating = 0
        for rank, s in enumerate(slots):
            started, later = s.admissions(self.active[rank])
            self.activate(rank, started, now)
            s.ready.extend(later)
            admitted += len(started)
            branches += sum(r.branches for r in started) + sum(r.branches for r in later)
            generating += sum(not r.decodes or r.gen_at_admission for r in started)
        self.starved = [0] * len(self.starved)  # every free slot was filled, or the queue ran dry
        self.total_starved = 0
        self.starving_since.clear()
        return admitted, branches, generating

    def finish(self, now: int) -> list[int]:
        """The ranks (once per request) whose requests took their last step on pass `now`."""
        done = self.finishing.pop(now, [])
        self.decoding -= self.decoders.pop(now, 0)
        for rank in done:
            self.active[rank] -= 1
        self.total_active -= len(done)
        return done


def simulate(
    queues: list[list[SimRequest]],
    max_active: int,
    rule: PrefillRule,
    part_bytes: PartBytes = PartBytes(),
    und_cache: bool = True,
    ranks_per_queue: int = 1,
) -> Simulation:
    """Replay the runner's loop (`PassRunner._loop`) pass by pass; see there for each step's meaning.
    A queue is one rank's, or with --sp one group's (`ranks_per_queue` ranks, each moving the weights).

    Event-driven, so that 1M requests at 512 ranks take seconds, not minutes: a pass touches only the ranks
    whose requests finished on the pass before (they take prefilled requests into their free slots, the
    `RankSlots` code the runner runs), and on a UND pass every rank (admissions). The per-pass sums of
    `RankSlots.report` are kept as running totals (`_Totals`): a rank's free slots, queue and ready list
    change only at those events, and a starved rank stays starved until the next UND pass (its slots can be
    filled only by admissions), so its wait is the passes since its starvation began. Equal to the
    pass-by-pass replay (tests/unit/test_simulator.py holds both on random queues)."""
    world = len(queues)
    rule = rule if und_cache else replace(rule, lookahead=0)
    slots = [RankSlots(deque(q), max_active, rule) for q in queues]
    totals = _Totals(world, max_active)
    pending = sum(len(q) for q in queues)
    passes = und_passes = gen_passes = prefilled = outputs = skipped = decoding = 0
    touched = list(range(world))  # ranks whose requests finished on the pass before (at first: all)
    while True:
        for rank in touched:  # their freed slots take prefilled requests, or starve
            ready = slots[rank].take_ready(totals.active[rank])
            pending -= len(ready)
            totals.activate(rank, ready, passes)
            totals.settle(rank, bool(slots[rank].queue), passes)
        if totals.total_active == 0 and pending == 0:
            break
        overdue = totals.overdue(passes, rule.max_wait)
        und = und_pass(rule, world * max_active, totals.total_active, totals.total_starved, overdue)
        und = und or (not und_cache and totals.total_active > 0) or totals.decoding > 0
        # The runner's GEN rule: some request active before admissions computes its step (it neither decodes
        # nor reuses on this pass), or, on a UND pass, some rank admits a request with GEN work.
        computing = totals.total_active - totals.decoding - totals.reusing.pop(passes, 0)
        generating = 0
        if und:
            admitted, branches, generating = totals.admit(slots, passes)
            pending -= admitted
            prefilled += branches
        gen = gen_pass(und, computing, generating)
        skipped += not und and not gen  # no GEN work and no UND pass: nothing fetched, no layer walked
        decoding += totals.decoding > 0  # after admissions: a reasoner admitted now decodes on this pass
        passes += 1
        und_passes += und
        gen_passes += gen
        touched = totals.finish(passes - 1)
        outputs += len(touched)
        touched = sorted(set(touched))
    if not und_cache:  # the ablation recomputes every active branch's UND half every step
        prefilled = sum(r.steps * r.branches for q in queues for r in q)
    per_rank = gen_passes * part_bytes.gen + und_passes * part_bytes.und
    moved = per_rank * world * ranks_per_queue
    return Simulation(
        passes=passes,
        und_passes=und_passes,
        outputs=outputs,
        occupancy=totals.active_sum / (passes * world * max_active) if passes else 0.0,
        bytes_per_rank=per_rank,
        bytes_per_output=moved / outputs if outputs else 0.0,
        und_byte_share=und_passes * part_bytes.und / per_rank if per_rank else 0.0,
        und_sequence_runs=prefilled,
        skipped_passes=skipped,
        decode_passes=decoding,
        decode_und_bytes=decoding * part_bytes.und * world * ranks_per_queue,
        gen_passes=gen_passes,
    )
