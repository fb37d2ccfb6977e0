"""The pass simulator and the prefill rule, by hand; its exactness against real runs is in tests/dist."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cosmos3_batch.plan import prefill, simulator
from cosmos3_batch.plan.prefill import PrefillRule
from cosmos3_batch.plan.simulator import PartBytes, SimRequest, simulate

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
