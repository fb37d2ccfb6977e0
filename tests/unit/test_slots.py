"""slots.py: which part goes into which slot, and when (pure bookkeeping; exact issue orders)."""

from __future__ import annotations

import pytest

from cosmos3_batch.engine.slots import SlotScheduler

LAYERS = 3
LANES = ["und", "gen"] * LAYERS  # part 2l: UND half of layer l, part 2l + 1: its GEN half


def walk(scheduler: SlotScheduler, order: list[int], prefetch: tuple[int, ...] = ()) -> list[tuple]:
    """What LayerOffload does in a pass; returns the log of issues (part, slot) and frees (slot)."""
    log: list[tuple] = []
    for part in [p for p in order if p not in scheduler.outstanding(LANES[p])] + list(prefetch):
        scheduler.want(part)
    log += [("issue", *x) for x in scheduler.pump()]
    for part in order:
        slot, freed = scheduler.acquire(part)
        log += [("free", freed)] if freed is not None else []
        log.append(("use", part, slot))
        log += [("issue", *x) for x in scheduler.pump()]
    freed = scheduler.end_pass()
    log += [("free", freed)] if freed is not None else []
    log += [("issue", *x) for x in scheduler.pump()]
    return log


def test_gen_lane_has_two_slots_und_one():
    scheduler = SlotScheduler(LANES, {"gen": 2, "und": 1})
    assert scheduler.slot_lane == ["und", "gen", "gen"]


def test_und_pass_keeps_the_next_gen_part_in_flight():
    scheduler = SlotScheduler(LANES, {"gen": 2, "und": 1})
    log = walk(scheduler, list(range(2 * LAYERS)), prefetch=(1,))
    issues = [entry[1] for entry in log if entry[0] == "issue"]
    # U0 G0 G1 up front; G2 as soon as G0's slot frees (when U1 is acquired), before U2: UND never holds a
    # GEN fetch back. The next pass's G0 goes as soon as G1's slot frees, before this pass ends.
    assert issues == [0, 1, 3, 2, 5, 4, 1]
    uses = [entry for entry in log if entry[0] == "use"]
    assert uses == [("use", 0, 0), ("use", 1, 1), ("use", 2, 0), ("use", 3, 2), ("use", 4, 0), ("use", 5, 1)]
    assert log[-1] == ("free", 1)  # G2's slot, at the end of the pass; G0' already holds slot 2


def test_gen_pass_then_und_pass_starts_from_the_prefetched_part():
    scheduler = SlotScheduler(LANES, {"gen": 2, "und": 1})
    walk(scheduler, [1, 3, 5], prefetch=(1,))
    assert scheduler.outstanding("gen") == [1]
    log = walk(scheduler, list(range(2 * LAYERS)), prefetch=(1,))
    issues = [entry[1] for entry in log if entry[0] == "issue"]
    assert issues == [0, 3, 2, 5, 4, 1]  # G0 came from the pass before


def test_a_und_only_pass_fetches_each_und_part_into_the_slot_the_one_before_frees():
    """A pass without GEN work walks the one-slot UND lane alone: U_l+1 waits for U_l's slot, freed when it
    is asked for (free_held), never before; the GEN part prefetched by an earlier pass stays where it is."""
    scheduler = SlotScheduler(LANES, {"gen": 2, "und": 1})
    walk(scheduler, [1, 3, 5], prefetch=(1,))
    for part in (0, 2, 4):
        scheduler.want(part)
    assert scheduler.pump() == [(0, 0)]
    log = []
    for part in (0, 2, 4):
        if not scheduler.issued(part):
            log.append(("free", scheduler.free_held()))
            log += [("issue", *x) for x in scheduler.pump()]
        log.append(("use", part, scheduler.acquire(part)[0]))
    assert log == [("use", 0, 0), ("free", 0), ("issue", 2, 0), ("use", 2, 0), ("free", 0), ("issue", 4, 0),
                   ("use", 4, 0)]  # fmt: skip
    assert scheduler.end_pass() == 0 and scheduler.outstanding("gen") == [1]


def test_acquiring_a_part_never_fetched_is_an_error():
    scheduler = SlotScheduler(LANES, {"gen": 2, "und": 1})
    scheduler.want(1)
    scheduler.pump()
    with pytest.raises(RuntimeError, match="part 3 acquired before it was fetched"):
        scheduler.acquire(3)
    with pytest.raises(ValueError, match="at least one slot"):
        SlotScheduler(LANES, {"und": 0})
