"""The pass simulator (DESIGN.md §4): the pass protocol replayed without a model, torch-free.

Same schedule (the caller passes `schedule.assign`'s queues), same admission and prefill rule (the
`prefill` module the runner uses), same per-request step and branch counts, same part byte sizes. Its
passes, UND passes and bytes equal a real run's counters exactly when no request fails (a test holds
this at world sizes 1-4), so `plan` can size a 64-GPU job from a laptop.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, replace
from operator import attrgetter

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
    # A reasoner stage chained to a generation request (its upsampling, its captions): it decodes in that
    # request's generation slot, not in a reasoner slot (--max-reason-active). An upsampling is one.
    chained: bool = False

    def __post_init__(self) -> None:
        assert not self.decisions or len(self.decisions) == self.steps, (self.id, self.decisions)

    @property
    def reasoner(self) -> bool:
        """It takes a reasoner slot (prefill.py RankSlots' second pool): a reasoner request of its own."""
        return self.decodes and not (self.chained or self.gen_at_admission)


REASONER = attrgetter("reasoner")  # a stand-in's pool of slots (RankSlots)


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
    occupancy: float  # mean share of generation slots (--max-active) active over all passes and ranks
    bytes_per_rank: int  # weight bytes each rank moves over the run
    bytes_per_output: float  # all ranks' weight bytes / outputs
    und_byte_share: float  # share of the weight bytes that were UND halves
    und_sequence_runs: int  # branches prefilled (each runs the UND half of every layer once)
    skipped_passes: int = 0  # passes that fetched nothing: no GEN work (--cache sea: all reused) and no UND
    decode_passes: int = 0  # passes on which some reasoner request was active (each a UND pass)
    decode_und_bytes: int = 0  # all ranks' UND weight bytes moved on those passes
    gen_passes: int = 0  # passes that fetched the GEN parts: some request computed its step's GEN branches
    reason_occupancy: float = 0.0  # mean share of reasoner slots (--max-reason-active) active, likewise

    def to_dict(self) -> dict:
        return asdict(self)


class _Totals:
    """The per-pass sums of `RankSlots.report`, kept as running totals (see `simulate`), per pool of slots
    (generation, reasoner: prefill.py): requests active and slots starved, per rank and over all ranks; the
    first pass of each rank's current starvation; the (rank, pool) of requests taking their last step on each
    pass; and the active requests summed over the passes."""

    def __init__(self, world: int, sizes: tuple[int, int]):
        self.sizes = sizes  # slots per rank: (--max-active, --max-reason-active)
        self.active = [[0] * world, [0] * world]  # per pool, requests active per rank
        self.starved = [[0] * world, [0] * world]  # per pool, free slots with nothing prefilled while queued
        self.total_active = 0
        self.total_starved = [0, 0]
        self.active_sum = [0, 0]
        self.finishing: dict[int, list[tuple[int, int]]] = {}  # pass -> (rank, pool) taking its last step
        self.starving_since: deque[int] = deque()  # first pass of each current starvation, oldest first
        self.reusing: dict[int, int] = {}  # pass -> active requests all of whose branches reuse on it
        self.decoding = 0  # active reasoner requests: while any, every pass fetches the UND parts
        self.decoders: dict[int, int] = {}  # pass -> reasoner requests taking their last step in it

    def counts(self, rank: int) -> tuple[int, int]:
        return self.active[0][rank], self.active[1][rank]

    def activate(self, rank: int, jobs: list[SimRequest], now: int) -> None:
        for r in jobs:
            pool = int(r.reasoner)
            self.finishing.setdefault(now + r.steps - 1, []).append((rank, pool))
            if r.decodes:
                self.decoding += 1
                self.decoders[now + r.steps - 1] = self.decoders.get(now + r.steps - 1, 0) + 1
            self.active_sum[pool] += r.steps  # active on this pass and each of its remaining steps
            self.active[pool][rank] += 1
            for step, decision in enumerate(r.decisions):  # step i is taken on pass now + i
                if decision == "R":
                    self.reusing[now + step] = self.reusing.get(now + step, 0) + 1
        self.total_active += len(jobs)

    def settle(self, rank: int, slots: RankSlots, now: int) -> None:
        """After a rank's free slots took what was ready: a pool's starve if its requests are still queued."""
        was = self.starved[0][rank] + self.starved[1][rank]
        for pool, size in enumerate(self.sizes):
            starved = size - self.active[pool][rank] if slots.queues[pool] else 0
            self.total_starved[pool] += starved - self.starved[pool][rank]
            self.starved[pool][rank] = starved
        if not was and self.starved[0][rank] + self.starved[1][rank]:
            self.starving_since.append(now)

    def overdue(self, now: int, max_wait: int) -> int:
        """1 if the oldest starved slot, waiting `now - since + 1` passes, is past max_wait."""
        return int(bool(self.starving_since) and now - self.starving_since[0] + 1 > max_wait)

    def admit(self, slots: list[RankSlots], now: int) -> tuple[int, int, int]:
        """A UND pass: every rank admits into its free slots (the rest of the prefilled become ready), so
        none starves after it. Returns (requests admitted now, branches prefilled, of the admitted those with
        GEN work on this pass)."""
        admitted = branches = generating = 0
        for rank, s in enumerate(slots):
            started, later = s.admissions(self.counts(rank))
            self.activate(rank, started, now)
            s.ready.extend(later)
            admitted += len(started)
            branches += sum(r.branches for r in started) + sum(r.branches for r in later)
            generating += sum(not r.decodes or r.gen_at_admission for r in started)
        self.starved = [[0] * len(self.starved[0]), [0] * len(self.starved[0])]  # every free slot was filled,
        self.total_starved = [0, 0]  # or its pool's queue ran dry
        self.starving_since.clear()
        return admitted, branches, generating

    def finish(self, now: int) -> list[int]:
        """The ranks (once per request) whose requests took their last step on pass `now`."""
        done = self.finishing.pop(now, [])
        self.decoding -= self.decoders.pop(now, 0)
        for rank, pool in done:
            self.active[pool][rank] -= 1
        self.total_active -= len(done)
        return [rank for rank, _ in done]


def simulate(
    queues: list[list[SimRequest]],
    max_active: int,
    rule: PrefillRule,
    part_bytes: PartBytes = PartBytes(),
    und_cache: bool = True,
    ranks_per_queue: int = 1,
    max_reason_active: int | None = None,
) -> Simulation:
    """Replay the runner's loop (`PassRunner._loop`) pass by pass; see there for each step's meaning.
    A queue is one rank's, or with --sp one group's (`ranks_per_queue` ranks, each moving the weights).
    `max_reason_active`: the reasoner slots per rank (None: as many as `max_active`).

    Event-driven, so that 1M requests at 512 ranks take seconds, not minutes: a pass touches only the ranks
    whose requests finished on the pass before (they take prefilled requests into their free slots, the
    `RankSlots` code the runner runs), and on a UND pass every rank (admissions). The per-pass sums of
    `RankSlots.report` are kept as running totals (`_Totals`): a rank's free slots, queue and ready list
    change only at those events, and a starved rank stays starved until the next UND pass (its slots can be
    filled only by admissions), so its wait is the passes since its starvation began. Equal to the
    pass-by-pass replay (tests/unit/test_simulator.py holds both on random queues)."""
    world = len(queues)
    rule = rule if und_cache else replace(rule, lookahead=0)
    sizes = (max_active, max_active if max_reason_active is None else max_reason_active)
    slots = [RankSlots(q, max_active, rule, sizes[1], REASONER) for q in queues]
    totals = _Totals(world, sizes)
    pending = sum(len(q) for q in queues)
    passes = und_passes = gen_passes = prefilled = outputs = skipped = decoding = 0
    touched = list(range(world))  # ranks whose requests finished on the pass before (at first: all)
    while True:
        for rank in touched:  # their freed slots take prefilled requests, or starve
            ready = slots[rank].take_ready(totals.counts(rank))
            pending -= len(ready)
            totals.activate(rank, ready, passes)
            totals.settle(rank, slots[rank], passes)
        if totals.total_active == 0 and pending == 0:
            break
        overdue = totals.overdue(passes, rule.max_wait)
        starved, reason_starved = totals.total_starved
        reason = (world * sizes[1], reason_starved)
        und = und_pass(rule, world * max_active, totals.total_active, starved, overdue, reason)
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
    return _result(queues, (passes, und_passes, gen_passes, skipped, decoding), outputs, prefilled, totals,
                   part_bytes, und_cache, ranks_per_queue)  # fmt: skip


def _result(queues, counts: tuple, outputs: int, prefilled: int, totals: _Totals, part_bytes: PartBytes,
            und_cache: bool, ranks_per_queue: int) -> Simulation:  # fmt: skip
    """The replay's counts as a `Simulation`; `counts`: (passes, UND, GEN, skipped, decoding passes)."""
    passes, und_passes, gen_passes, skipped, decoding = counts
    world = len(queues)
    if not und_cache:  # the ablation recomputes every active branch's UND half every step
        prefilled = sum(r.steps * r.branches for q in queues for r in q)
    per_rank = gen_passes * part_bytes.gen + und_passes * part_bytes.und
    moved = per_rank * world * ranks_per_queue
    slot_passes = [passes * world * size for size in totals.sizes]
    return Simulation(
        passes=passes,
        und_passes=und_passes,
        outputs=outputs,
        occupancy=totals.active_sum[0] / slot_passes[0] if passes else 0.0,
        bytes_per_rank=per_rank,
        bytes_per_output=moved / outputs if outputs else 0.0,
        und_byte_share=und_passes * part_bytes.und / per_rank if per_rank else 0.0,
        und_sequence_runs=prefilled,
        skipped_passes=skipped,
        decode_passes=decoding,
        decode_und_bytes=decoding * part_bytes.und * world * ranks_per_queue,
        gen_passes=gen_passes,
        reason_occupancy=totals.active_sum[1] / slot_passes[1] if passes else 0.0,
    )
