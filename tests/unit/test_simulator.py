"""The pass simulator and the prefill rule, by hand; its exactness against real runs is in tests/dist."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cosmos3_batch.plan import prefill, simulator
from cosmos3_batch.plan.prefill import PrefillRule, RankSlots, und_pass
from cosmos3_batch.plan.simulator import PartBytes, SimRequest, Simulation, simulate

REQUESTS = [SimRequest("a", 2), SimRequest("b", 3, branches=2), SimRequest("c", 1)]


def test_without_lookahead_a_freed_slot_waits_for_a_und_pass():
    # Pass 1: nothing active -> UND, a and b admitted. Pass 2: no free slot; a ends. Pass 3: c queued, the
    # free slot has waited one pass > max_wait 0 -> UND, c admitted; b and c end. Nothing is left.
    sim = simulate([REQUESTS], 2, PrefillRule(free_share=1.0, max_wait=0, lookahead=0), PartBytes(10, 7))
    assert (sim.passes, sim.und_passes, sim.outputs) == (3, 2, 3)
    assert sim.bytes_per_rank == 3 * 10 + 2 * 7 and sim.bytes_per_output == pytest.approx(44 / 3)
    assert sim.occupancy == 1.0
    assert sim.und_sequence_runs == 1 + 2 + 1


def test_a_request_prefilled_ahead_takes_the_slot_without_a_und_pass():
    # Pass 1 also prefills c; in pass 3 it fills a's slot at once.
    sim = simulate([REQUESTS], 2, PrefillRule(free_share=1.0, max_wait=0, lookahead=1), PartBytes(10, 7))
    assert (sim.passes, sim.und_passes, sim.occupancy) == (3, 1, 1.0)
    assert sim.und_byte_share == pytest.approx(7 / 37)


def test_und_pass_rule():
    rule = PrefillRule(free_share=0.25, max_wait=4, lookahead=2)
    assert not prefill.und_pass(rule, 16, active=0, starved=0, overdue=0)  # nothing to admit
    assert prefill.und_pass(rule, 16, active=0, starved=1, overdue=0)  # nothing runs: must prefill
    assert not prefill.und_pass(rule, 16, active=12, starved=3, overdue=0)  # 3 < 16/4
    assert prefill.und_pass(rule, 16, active=12, starved=4, overdue=0)
    assert prefill.und_pass(rule, 16, active=15, starved=1, overdue=1)  # a slot waited too long


def test_rank_slots_wait_and_lookahead_bounds():
    from collections import deque

    slots = prefill.RankSlots(deque(range(10)), 4, PrefillRule(0.25, 2, 3))
    assert slots.report(active=4).starved == 0
    assert [slots.report(active=3).overdue for _ in range(3)] == [0, 0, 1]  # waited 1, 2, 3 > 2
    now, later = slots.admissions(active=3)
    assert (now, later, slots.waited) == ([0], [1, 2, 3], 0)
    slots.ready.extend(later)
    assert slots.take_ready(active=2) == [1, 2] and list(slots.ready) == [3]
    assert slots.admissions(active=4) == ([], [4, 5])  # tops the ready list up to 3


def test_each_pool_admits_alone_in_schedule_order():
    """Generation and reasoner requests (r*) queued on one rank take slots of their own pool: a full pool
    never holds up the other's admissions, and the look-ahead takes the next of both in schedule order."""
    from collections import deque

    rule = PrefillRule(0.25, 0, 2)
    slots = RankSlots(deque(["g0", "r1", "r2", "r3", "g4", "r5", "g6"]), 1, rule, 2, lambda x: x[0] == "r")
    assert slots.admitting((0, 0)) == ["g0", "r1", "r2"]
    assert slots.admissions((0, 0)) == (["g0", "r1", "r2"], ["r3", "g4"])
    slots.ready.extend(["r3", "g4"])
    assert slots.report((1, 2)) == prefill.SlotReport(0, 0, 4, 0)  # both pools full
    assert slots.take_ready((0, 2)) == ["g4"] and list(slots.ready) == ["r3"]  # r3 waits for a reasoner slot
    assert slots.report((1, 2)) == prefill.SlotReport(0, 0, 3, 0)
    assert slots.take_ready((1, 1)) == ["r3"]
    assert slots.report((1, 1)) == prefill.SlotReport(0, 1, 2, 1)  # r5 queued: a starved reasoner slot
    assert slots.report((0, 1)) == prefill.SlotReport(1, 1, 2, 1)  # and g6: a starved generation slot
    slots.requeue(["g9"])  # back at the head: the next admission, before g6
    assert slots.waiting() == ["g9", "r5", "g6"]
    assert slots.admissions((0, 1)) == (["g9", "r5"], ["g6"])


def test_reasoners_beyond_max_active_share_passes_beside_a_full_generation_slot():
    """One generation slot busy with g (4 steps) while 6 reasoners (3 tokens each) take 4 reasoner slots: the
    first 4 decode on passes 0-2 beside g, the other 2 on passes 3-5 (admitted on the UND pass their
    decoding makes every pass); then h takes the generation slot when g ends (pass 4)."""
    queue = [SimRequest(f"r{i}", 3, decodes=True) for i in range(6)]
    queue[2:2] = [SimRequest("g", 4), SimRequest("h", 2)]
    sim = simulate([queue], 1, PrefillRule(1.0, 0, 0), PartBytes(10, 7), max_reason_active=4)
    assert (sim.passes, sim.und_passes, sim.gen_passes, sim.decode_passes, sim.outputs) == (6, 6, 6, 6, 8)
    assert sim.occupancy == 1.0 and sim.reason_occupancy == (4 * 3 + 2 * 3) / (6 * 4)
    shared = simulate([queue], 1, PrefillRule(1.0, 0, 0), PartBytes(10, 7), max_reason_active=1)
    assert (shared.passes, shared.decode_passes) == (18, 18)  # one reasoner a pass: 6 x 3 tokens


def test_rule_flags_are_validated():
    for bad in ({"free_share": 0.0}, {"free_share": 1.5}, {"max_wait": -1}, {"lookahead": -1}):
        with pytest.raises(ValueError, match="--prefill-"):
            PrefillRule(**bad)


def test_the_ablation_runs_every_step_as_a_und_pass():
    sim = simulate([REQUESTS], 2, PrefillRule(), PartBytes(10, 7), und_cache=False)
    assert sim.und_passes == sim.passes and sim.und_sequence_runs == 2 + 3 * 2 + 1


@pytest.mark.parametrize("module", [prefill, simulator])
def test_simulator_and_rule_import_no_torch(module):
    tree = ast.parse(Path(module.__file__).read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not any(name.split(".")[0] == "torch" for name in names), names


def replay(
    queues, max_active, rule, part_bytes: PartBytes, und_cache: bool = True, reason_slots: int | None = None
) -> Simulation:
    """The runner's loop replayed pass by pass, every rank every pass, with `RankSlots` as the runner uses it:
    what the event-driven `simulate` must equal (it was the simulator before 1M requests at 512 ranks)."""
    from collections import deque

    world = len(queues)
    rule = rule if und_cache else PrefillRule(rule.free_share, rule.max_wait, lookahead=0)
    sizes = (max_active, max_active if reason_slots is None else reason_slots)
    slots = [RankSlots(deque(q), max_active, rule, sizes[1], simulator.REASONER) for q in queues]
    active: list[list[list]] = [[] for _ in queues]  # per rank: [steps left, request]
    passes = und_passes = gen_passes = prefilled = outputs = skipped = decode_passes = 0
    active_sum = [0, 0]

    def counts(rank: int) -> tuple[int, int]:
        reasoning = sum(r.reasoner for _, r in active[rank])
        return len(active[rank]) - reasoning, reasoning

    while True:
        for rank, s in enumerate(slots):
            active[rank] += [[r.steps, r] for r in s.take_ready(counts(rank))]
        reports = [s.report(counts(rank)) for rank, s in enumerate(slots)]
        jobs = [job for a in active for job in a]
        if not jobs and sum(r.pending for r in reports) == 0:
            break
        # What the exchange carries: a reasoner decoding (needs UND), branches that compute (a reasoner has
        # none; --cache sea: a step all of whose branches reuse has none), requests with GEN work admitted.
        decoding = any(r.decodes for _, r in jobs)
        computing = sum(not r.decodes and (not r.decisions or r.decisions[-left] == "C") for left, r in jobs)
        heads = [r for rank, s in enumerate(slots) for r in s.admitting(counts(rank))]
        admits = sum(not r.decodes or r.gen_at_admission for r in heads)
        starved, overdue = sum(r.starved for r in reports), sum(r.overdue for r in reports)
        reason = (world * sizes[1], sum(r.reason_starved for r in reports))
        und = und_pass(rule, world * max_active, len(jobs), starved, overdue, reason)
        und = und or (not und_cache and len(jobs) > 0) or decoding
        if und:
            for rank, s in enumerate(slots):
                now, later = s.admissions(counts(rank))
                active[rank] += [[r.steps, r] for r in now]
                s.ready.extend(later)
                prefilled += sum(r.branches for r in now) + sum(r.branches for r in later)
        gen = computing > 0 or (und and admits > 0)
        passes, und_passes, gen_passes = passes + 1, und_passes + und, gen_passes + gen
        skipped += not und and not gen
        decode_passes += any(r.decodes for a in active for _, r in a)
        for rank in range(world):
            for pool, n in enumerate(counts(rank)):
                active_sum[pool] += n
            for job in active[rank]:
                job[0] -= 1
            outputs += sum(1 for job in active[rank] if job[0] <= 0)
            active[rank] = [job for job in active[rank] if job[0] > 0]
    if not und_cache:
        prefilled = sum(r.steps * r.branches for q in queues for r in q)
    per_rank = gen_passes * part_bytes.gen + und_passes * part_bytes.und
    occupancy = [active_sum[p] / (passes * world * sizes[p]) if passes else 0.0 for p in (0, 1)]
    share = und_passes * part_bytes.und / per_rank if per_rank else 0.0
    per_output = per_rank * world / outputs if outputs else 0.0
    decode_bytes = decode_passes * part_bytes.und * world
    return Simulation(passes, und_passes, outputs, occupancy[0], per_rank, per_output, share, prefilled,
                      skipped, decode_passes, decode_bytes, gen_passes, occupancy[1])  # fmt: skip


def random_request(rng, rid: str, cached: bool, reasoners: bool = False) -> SimRequest:
    """Steps and branches at random; with `cached`, replayed --cache sea decisions: the first step computes
    (SeaCache forces it), the others reuse often, so that whole passes reuse on some seeds. With `reasoners`,
    one request in three decodes (no GEN work; some counted as GEN work when admitted, as an upsampling)."""
    steps = rng.randint(1, 12)
    if reasoners and rng.random() < 1 / 3:  # a reasoner request, an upsampling (in a generation slot) or a
        stage = rng.random()  # caption (likewise)
        return SimRequest(rid, steps, 1, decodes=True, gen_at_admission=stage < 0.2, chained=stage > 0.85)
    decisions = "C" + "".join(rng.choice("CRRR") for _ in range(steps - 1)) if cached else ""
    return SimRequest(rid, steps, rng.choice([1, 2]), decisions)


@pytest.mark.parametrize("seed", range(16))
def test_the_event_driven_simulator_equals_the_pass_by_pass_replay(seed):
    import random

    rng = random.Random(seed)
    world, max_active = rng.choice([1, 2, 3, 7, 16]), rng.choice([1, 2, 4])
    rule = PrefillRule(rng.choice([0.1, 0.25, 0.5, 1.0]), rng.choice([0, 1, 2, 5]), rng.choice([0, 1, 3]))
    cached, reasoners = seed % 3 != 0, seed % 2 == 1
    queues = [[random_request(rng, f"r{q}-{i}", cached, reasoners) for i in range(rng.randint(0, 30))]
              for q in range(world)]  # fmt: skip
    und_cache = seed % 5 != 4
    reason_slots = rng.choice([1, 2, 5])  # the reasoner requests' own pool (--max-reason-active)
    expected = replay(queues, max_active, rule, PartBytes(10, 7), und_cache, reason_slots)
    assert simulate(queues, max_active, rule, PartBytes(10, 7), und_cache, 1, reason_slots) == expected


def test_the_random_cached_queues_skip_some_passes():
    """Guards the test above: its replayed decisions do make whole passes skip on some seeds."""
    import random

    skipped = 0
    for seed in range(1, 12, 3):
        rng = random.Random(seed)
        queues = [[random_request(rng, f"r{q}-{i}", True) for i in range(8)] for q in range(2)]
        skipped += simulate(queues, 1, PrefillRule(), PartBytes(10, 7)).skipped_passes
    assert skipped > 0


def test_the_random_queues_with_reasoners_fetch_und_alone_on_some_passes():
    """Guards the replay test: with reasoners, some passes fetch the UND parts alone (no GEN work anywhere),
    some fetch both (a reasoner decoding beside a generation request)."""
    import random

    und_alone = both = 0
    for seed in range(1, 12, 2):
        rng = random.Random(seed)
        queues = [
            [random_request(rng, f"r{q}-{i}", seed % 3 != 0, True) for i in range(10)] for q in range(2)
        ]
        sim = simulate(queues, 2, PrefillRule(), PartBytes(10, 7))
        und_alone += sim.passes - sim.gen_passes - sim.skipped_passes
        both += both_fetched(sim)
    assert und_alone > 0 and both > 0


def both_fetched(sim: Simulation) -> int:
    """Passes that fetched GEN and UND parts: every pass fetched GEN alone, UND alone, both or nothing."""
    return sim.gen_passes + sim.und_passes + sim.skipped_passes - sim.passes
