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
* Slots come in two pools (`RankSlots`): `--max-active` for generation requests, `--max-reason-active` for
  reasoner requests, each filled from its own requests in schedule order and starving on its own; the share
  rule applies to each pool (`und_pass`'s `reason`), so a job without reasoners passes as it always did.

The decision reads only the per-pass all-reduce's sums, so every rank takes the same one.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
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
    starved: int  # free generation slots that the ready list cannot fill while such requests are queued
    overdue: int  # 1 when a starved slot here has waited max_wait passes
    pending: int  # queued + ready requests left on this rank
    reason_starved: int = 0  # the same for the reasoner slots (--max-reason-active)


def und_pass(
    rule: PrefillRule,
    world_slots: int,
    active: int,
    starved: int,
    overdue: int,
    reason: tuple[int, int] = (0, 0),
) -> bool:
    """The world's decision from the all-reduced sums: fetch the UND halves this pass? `reason`: (the world's
    reasoner slots, those starved), a pool of its own under the same share rule (a job without reasoner
    requests never starves one, so its passes are as before)."""
    reason_slots, reason_starved = reason
    if starved == 0 and reason_starved == 0:
        return False
    shares = starved >= math.ceil(rule.free_share * world_slots) or (
        reason_starved > 0 and reason_starved >= math.ceil(rule.free_share * reason_slots)
    )
    return active == 0 or overdue > 0 or shares


def gen_pass(und: bool, computing: int, admits_gen: int) -> bool:
    """The world's decision from the all-reduced sums: fetch the GEN parts this pass? Only when some branch
    active before admissions runs the decoder stack (a reasoner's has no GEN branch, a reused one runs none),
    or a UND pass admits a request with GEN work (its first step computes). A reasoner-only pass fetches the
    UND parts alone; a pass with neither fetches nothing and walks no layer (--cache sea's skipped pass)."""
    return computing > 0 or (und and admits_gen > 0)


GEN_POOL, REASON_POOL = 0, 1  # the two pools of slots; `active` counts are (generation, reasoner) pairs


def pools(active: int | tuple[int, int]) -> tuple[int, int]:
    """An active count as (generation, reasoner): a bare int is generation requests alone."""
    return (active, 0) if isinstance(active, int) else active


class RankSlots:
    """One rank's queue and ready list: which requests to activate, and when to prefill which.

    Two pools of slots: `max_active` for generation requests (and the reasoner stages chained to one, which
    ride its slot), `max_reason` for reasoner requests (`reasoner(item)` tells an item's pool: a request in
    the queue, a job in the ready list). The queue is kept per pool, each in schedule order, so that a full
    pool never holds up the other's admissions; the look-ahead takes the next requests of both in schedule
    order. Items are opaque: the runner stores RequestJob / Request objects, the simulator its stand-ins."""

    def __init__(
        self,
        queue: Iterable,
        max_active: int,
        rule: PrefillRule,
        max_reason: int | None = None,
        reasoner: Callable[[object], bool] | None = None,
    ):
        self.reasoner = reasoner if reasoner is not None else (lambda item: False)
        self.sizes = (max_active, max_active if max_reason is None else max_reason)
        self.queues: tuple[deque, deque] = (deque(), deque())  # not yet admitted (requests), per pool
        self._places: tuple[deque, deque] = (deque(), deque())  # their places in the schedule
        for place, item in enumerate(queue):
            pool = int(self.reasoner(item))
            self.queues[pool].append(item)
            self._places[pool].append(place)
        self._first = 0  # the place before every queued one: requeued requests go first
        self.ready: deque = deque()  # admitted and prefilled, waiting for a slot (jobs)
        self.rule = rule
        self.waited = 0  # passes the oldest starved slot has waited

    @property
    def queued(self) -> int:
        return len(self.queues[0]) + len(self.queues[1])

    def waiting(self) -> list:
        """The requests not admitted yet, in schedule order."""
        return [item for _, item in sorted(self._indexed(), key=lambda pair: pair[0])]

    def requeue(self, items: list) -> None:
        """Back at the head of the queue, in this order (a request whose prompt was just upsampled)."""
        for item in reversed(items):
            pool = int(self.reasoner(item))
            self._first -= 1
            self.queues[pool].appendleft(item)
            self._places[pool].appendleft(self._first)

    def _free(self, active: int | tuple[int, int]) -> list[int]:
        return [size - n for size, n in zip(self.sizes, pools(active), strict=True)]

    def take_ready(self, active: int | tuple[int, int]) -> list:
        """Before the exchange: prefilled jobs that move into free slots of their pool now (no UND needed)."""
        free, taken, kept = self._free(active), [], deque()
        for item in self.ready:
            pool = int(self.reasoner(item))
            if free[pool] > 0:
                free[pool] -= 1
                taken.append(item)
            else:
                kept.append(item)
        self.ready = kept
        return taken

    def report(self, active: int | tuple[int, int]) -> SlotReport:
        starved = [n if queue else 0 for n, queue in zip(self._free(active), self.queues, strict=True)]
        self.waited = self.waited + 1 if any(starved) else 0
        overdue = int(any(starved) and self.waited > self.rule.max_wait)
        return SlotReport(starved[0], overdue, self.queued + len(self.ready), starved[1])

    def admitting(self, active: int | tuple[int, int]) -> list:
        """Before the exchange: the requests `admissions` takes into free slots if this is a UND pass."""
        free = self._free(active)
        return [item for pool in (0, 1) for item in islice(self.queues[pool], max(free[pool], 0))]

    def admissions(self, active: int | tuple[int, int]) -> tuple[list, list]:
        """On a UND pass: (requests admitted into free slots, requests prefilled into the ready list), each in
        schedule order."""
        free = self._free(active)
        now = [
            self._pop(pool) for pool in (0, 1) for _ in range(min(max(free[pool], 0), len(self.queues[pool])))
        ]
        now = [item for _, item in sorted(now, key=lambda pair: pair[0])]
        ahead = min(self.rule.lookahead - len(self.ready), self.queued)
        later = [self._pop(self._next_pool())[1] for _ in range(max(ahead, 0))]
        self.waited = 0
        return now, later

    def _pop(self, pool: int) -> tuple[int, object]:
        return self._places[pool].popleft(), self.queues[pool].popleft()

    def _next_pool(self) -> int:
        """The pool whose next request comes first in the schedule."""
        if not self.queues[0] or not self.queues[1]:
            return 0 if self.queues[0] else 1
        return 0 if self._places[0][0] < self._places[1][0] else 1

    def _indexed(self):
        for pool in (0, 1):
            yield from zip(self._places[pool], self.queues[pool], strict=True)
