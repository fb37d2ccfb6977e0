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
    A queue is one rank's, or with --sp one group's (`ranks_per_queue` ranks, each moving the weights)."""
    world = len(queues)
    rule = rule if und_cache else PrefillRule(rule.free_share, rule.max_wait, lookahead=0)
    slots = [RankSlots(deque(q), max_active, rule) for q in queues]
    active: list[list[list]] = [[] for _ in queues]  # per rank: [remaining steps, branches]
    passes = und_passes = active_sum = prefilled = outputs = 0
    while True:
        for rank, s in enumerate(slots):
            active[rank] += s.take_ready(len(active[rank]))
        reports = [s.report(len(a)) for s, a in zip(slots, active, strict=True)]
        total_active = sum(len(a) for a in active)
        if total_active == 0 and sum(r.pending for r in reports) == 0:
            break
        und = und_pass(
            rule,
            world * max_active,
            total_active,
            sum(r.starved for r in reports),
            sum(r.overdue for r in reports),
        )
        und = und or (not und_cache and total_active > 0)
        if und:
            for rank, s in enumerate(slots):
                now, later = s.admissions(len(active[rank]))
                fresh = [[r.steps, r.branches] for r in now]
                active[rank] += fresh
                s.ready.extend([r.steps, r.branches] for r in later)
                prefilled += sum(b for _, b in fresh) + sum(r.branches for r in later)
        passes += 1
        und_passes += und
        for rank in range(world):
            active_sum += len(active[rank])
            for job in active[rank]:
                job[0] -= 1
            outputs += sum(1 for job in active[rank] if job[0] <= 0)
            active[rank] = [job for job in active[rank] if job[0] > 0]
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
