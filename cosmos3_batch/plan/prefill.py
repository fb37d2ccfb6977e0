"""When the world fetches the UND halves: coalesced prefill passes (DESIGN.md §4, "UND passes are rare").

Pure and torch-free: the runner and the pass simulator step through this very code, which is why the
simulator's counts equal a real run's exactly.

A UND pass moves every layer's UND half as well as its GEN half when some request has GEN work
(`gen_pass`; about twice a GEN-only pass for Cosmos3's Mixture-of-Transformers layers). Fetching them
whenever any rank admits a request makes most passes UND passes at scale, so admissions are coalesced:

* Each rank keeps a short *ready* list of requests whose UND K/V are already cached (prefilled
  ahead). A slot that frees is refilled from it at once, with no UND fetch.
* A slot that cannot be refilled that way (ready list empty, requests still queued) is *starved*.
  The whole world calls a UND pass when the starved slots reach `free_share` of all slots, or one
  rank's starved slot has waited `max_wait` passes, or nothing at all is active (the start).
* On a UND pass every rank admits requests into all its free slots (they prefill and take their
  first step in that pass) and prefills up to `lookahead` more into its ready list.

The decision reads only the per-pass all-reduce's sums, so every rank takes the same one.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from itertools import islice


@dataclass(frozen=True)
class PrefillRule:
    """Defaults chosen with the simulator (docs/scale.md, prefill passes)."""

    free_share: float = 0.25  # call a UND pass when this share of the world's slots is starved ...
    max_wait: int = 2  # ... or a starved slot has waited this many passes
    lookahead: int = 3  # requests per rank prefilled ahead of a free slot (their UND K/V held)
    # Passes a Transfer chain sits out at each chunk boundary (pipeline/kinds/transfer/chain.py) while the
    # finisher thread decodes its chunk and encodes the next one beside the other requests' passes; its slot
    # stays its own. A fixed count, not "when ready", so that every rank (and the simulator) knows the
    # schedule.
    chunk_gap: int = 2

    def __post_init__(self) -> None:
        if not 0.0 < self.free_share <= 1.0:
            raise ValueError(f"--prefill-free-share must be in (0, 1], got {self.free_share}")
        if self.max_wait < 0:
            raise ValueError(f"--prefill-max-wait must be >= 0, got {self.max_wait}")
        if self.lookahead < 0:
            raise ValueError(f"--prefill-lookahead must be >= 0, got {self.lookahead}")
        if self.chunk_gap < 0:
            raise ValueError(f"--chunk-gap-passes must be >= 0, got {self.chunk_gap}")


# Every rank sends these (with its active count, finished count and stop flag) in the per-pass all-reduce.
@dataclass(frozen=True)
class SlotReport:
    starved: int  # free slots that the ready list cannot fill while requests are still queued
    overdue: int  # 1 when a starved slot here has waited max_wait passes
    pending: int  # queued + ready requests left on this rank


def und_pass(rule: PrefillRule, world_slots: int, active: int, starved: int, overdue: int) -> bool:
    """The world's decision from the all-reduced sums: fetch the UND halves this pass?"""
    if starved == 0:
        return False
    return active == 0 or overdue > 0 or starved >= math.ceil(rule.free_share * world_slots)


def gen_pass(und: bool, computing: int, admits_gen: int) -> bool:
    """The world's decision from the all-reduced sums: fetch the GEN parts this pass? Only when some branch
    active before admissions runs the decoder stack (a reasoner's has no GEN branch, a reused one runs none),
    or a UND pass admits a request with GEN work (its first step computes). A reasoner-only pass fetches the
    UND parts alone; a pass with neither fetches nothing and walks no layer (--cache sea's skipped pass)."""
    return computing > 0 or (und and admits_gen > 0)


class RankSlots:
    """One rank's queue and ready list: which requests to activate, and when to prefill which.

    Items are opaque: the runner stores RequestJob / Request objects, the simulator its stand-ins."""

    def __init__(self, queue: deque, max_active: int, rule: PrefillRule):
        self.queue = queue  # not yet admitted (requests)
        self.ready: deque = deque()  # admitted and prefilled, waiting for a slot (jobs)
        self.max_active = max_active
        self.rule = rule
        self.waited = 0  # passes the oldest starved slot has waited

    def take_ready(self, active: int) -> list:
        """Before the exchange: prefilled jobs that move into free slots now (no UND needed)."""
        n = min(self.max_active - active, len(self.ready))
        return [self.ready.popleft() for _ in range(n)]

    def report(self, active: int) -> SlotReport:
        free = self.max_active - active
        starved = free if self.queue else 0
        self.waited = self.waited + 1 if starved else 0
        overdue = int(starved > 0 and self.waited > self.rule.max_wait)
        return SlotReport(starved, overdue, len(self.queue) + len(self.ready))

    def admitting(self, active: int) -> list:
        """Before the exchange: the requests `admissions` takes into free slots if this is a UND pass."""
        return list(islice(self.queue, max(self.max_active - active, 0)))

    def admissions(self, active: int) -> tuple[list, list]:
        """On a UND pass: (requests admitted into free slots, requests prefilled into the ready list)."""
        now = [self.queue.popleft() for _ in range(min(self.max_active - active, len(self.queue)))]
        ahead = min(self.rule.lookahead - len(self.ready), len(self.queue))
        later = [self.queue.popleft() for _ in range(max(ahead, 0))]
        self.waited = 0
        return now, later
