"""The pass simulator (DESIGN.md §4): the pass protocol replayed without a model, torch-free.

Same schedule (the caller passes `schedule.assign`'s queues), same admission and prefill rule (the
`prefill` module the runner uses), same per-request step and branch counts, same part byte sizes. Its
passes, UND passes and bytes equal a real run's counters exactly when no request fails (a test holds
this at world sizes 1-4), so `plan` can size a 64-GPU job from a laptop.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

from cosmos3_batch.plan.prefill import PrefillRule, RankSlots, und_pass


@dataclass(frozen=True)
class SimRequest:
    id: str
    steps: int
    branches: int = 1  # 2 with classifier-free guidance


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

    def to_dict(self) -> dict:
        return asdict(self)


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
    `RankSlots.report` are kept as running totals: a rank's free slots, queue and ready list change only at
    those events, and a starved rank stays starved until the next UND pass (its slots can be filled only
    by admissions), so its wait is the passes since its starvation began. Equal to the pass-by-pass replay
    (tests/unit/test_simulator.py holds both on random queues)."""
    world = len(queues)
    rule = rule if und_cache else PrefillRule(rule.free_share, rule.max_wait, lookahead=0)
    slots = [RankSlots(deque(q), max_active, rule) for q in queues]
    active = [0] * world  # requests active per rank
    starved = [0] * world  # free slots with nothing prefilled while requests are queued, per rank
    finishing: dict[int, list[int]] = {}  # pass -> ranks of the requests that take their last step in it
    starving_since: deque[int] = deque()  # first pass of each current starvation, oldest first
    total_active = total_starved = 0
    pending = sum(len(q) for q in queues)
    passes = und_passes = active_sum = prefilled = outputs = 0
    touched = list(range(world))  # ranks whose requests finished on the pass before (at first: all)

    def activate(rank: int, jobs, now: int) -> None:
        nonlocal total_active, active_sum
        for steps, _ in jobs:
            finishing.setdefault(now + steps - 1, []).append(rank)
            active_sum += steps  # active on this pass and each of its remaining steps
        active[rank] += len(jobs)
        total_active += len(jobs)

    while True:
        for rank in touched:  # their freed slots take prefilled requests, or starve
            s = slots[rank]
            ready = s.take_ready(active[rank])
            pending -= len(ready)
            activate(rank, ready, passes)
            now_starved = max_active - active[rank] if s.queue else 0
            if now_starved and not starved[rank]:
                starving_since.append(passes)
            total_starved += now_starved - starved[rank]
            starved[rank] = now_starved
        if total_active == 0 and pending == 0:
            break
        # The oldest starved slot has waited passes - since + 1 passes: overdue past max_wait.
        overdue = int(bool(starving_since) and passes - starving_since[0] + 1 > rule.max_wait)
        und = und_pass(rule, world * max_active, total_active, total_starved, overdue)
        und = und or (not und_cache and total_active > 0)
        if und:
            for rank, s in enumerate(slots):
                now, later = s.admissions(active[rank])
                pending -= len(now)
                activate(rank, [(r.steps, r.branches) for r in now], passes)
                s.ready.extend((r.steps, r.branches) for r in later)
                prefilled += sum(r.branches for r in now) + sum(r.branches for r in later)
                starved[rank] = 0  # every free slot was filled, or the queue ran dry
            total_starved = 0
            starving_since.clear()
        passes += 1
        und_passes += und
        touched = finishing.pop(passes - 1, [])
        outputs += len(touched)
        for rank in touched:
            active[rank] -= 1
        total_active -= len(touched)
        touched = sorted(set(touched))
    if not und_cache:  # the ablation recomputes every active branch's UND half every step
        prefilled = sum(r.steps * r.branches for q in queues for r in q)
    per_rank = passes * part_bytes.gen + und_passes * part_bytes.und
    moved = per_rank * world * ranks_per_queue
    return Simulation(
        passes=passes,
        und_passes=und_passes,
        outputs=outputs,
        occupancy=active_sum / (passes * world * max_active) if passes else 0.0,
        bytes_per_rank=per_rank,
        bytes_per_output=moved / outputs if outputs else 0.0,
        und_byte_share=und_passes * part_bytes.und / per_rank if per_rank else 0.0,
        und_sequence_runs=prefilled,
    )
