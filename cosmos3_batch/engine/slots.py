"""Which part goes into which device slot, and when: pure bookkeeping, no torch, no streams.

Parts belong to *lanes*, each with its own slots (Cosmos3: a "gen" lane with two slots and an "und"
lane with one). A lane's parts are fetched in the order they are wanted; across lanes, fetches are
issued in the order the parts were wanted, as soon as their lane has a free slot. A slot is free
again once the compute that read it has been issued, which is the moment the next part is acquired
(or the pass ends).

Why lanes: with one pool of two slots and the order [U_l, G_l] per layer, G_{l+1} can only go into
G_l's slot, so its fetch starts after G_l computes and overlaps only U_{l+1}'s short compute. With a
GEN lane of two slots and a UND slot, G_{l+1} is fetched while U_l and G_l compute, U_{l+1} while G_l
computes, and the next pass's first GEN part while the current pass finishes.

Every rank makes the same decisions from the same calls, so every rank issues the same gathers in
the same order (the collectives stay in lockstep).
"""

from __future__ import annotations

from collections import deque


class SlotScheduler:
    def __init__(self, lane_of: list[str], lane_slots: dict[str, int] | None = None):
        self.lane_of = lane_of  # part index -> lane
        self.slot_lane: list[str] = []  # slot index -> lane
        self._free: dict[str, deque[int]] = {}
        self._queue: dict[str, deque[tuple[int, int]]] = {}  # lane -> (wanted seq, part), lane order
        self._pending: dict[int, tuple[int, int]] = {}  # part -> (wanted seq, slot): issued, not acquired
        self._held: int | None = None  # slot of the part being computed
        self._seq = 0
        lane_slots = lane_slots or {}
        for lane in dict.fromkeys(lane_of):  # lanes in order of first appearance: stable slot ids
            count = lane_slots.get(lane, 2)
            if count < 1:
                raise ValueError(f"lane '{lane}' needs at least one slot, got {count}")
            self._free[lane] = deque(range(len(self.slot_lane), len(self.slot_lane) + count))
            self._queue[lane] = deque()
            self.slot_lane += [lane] * count

    @property
    def num_slots(self) -> int:
        return len(self.slot_lane)

    def want(self, part: int) -> None:
        """Part will be acquired after every part wanted before it in its lane."""
        self._queue[self.lane_of[part]].append((self._seq, part))
        self._seq += 1

    def outstanding(self, lane: str) -> list[int]:
        """This lane's parts issued or queued and not yet acquired, in acquisition order."""
        issued = sorted((seq, p) for p, (seq, _) in self._pending.items() if self.lane_of[p] == lane)
        return [p for _, p in issued] + [p for _, p in self._queue[lane]]

    def idle(self) -> bool:
        return not self._pending and not any(self._queue.values())

    def pump(self) -> list[tuple[int, int]]:
        """(part, slot) fetches to issue now, in issue order: repeatedly the earliest-wanted part whose
        lane has a free slot."""
        out = []
        while True:
            ready = [(q[0][0], lane) for lane, q in self._queue.items() if q and self._free[lane]]
            if not ready:
                return out
            _, lane = min(ready)
            seq, part = self._queue[lane].popleft()
            slot = self._free[lane].popleft()
            self._pending[part] = (seq, slot)
            out.append((part, slot))

    def acquire(self, part: int) -> tuple[int, int | None]:
        """(slot holding `part`, slot freed now or None): the previously acquired part's compute has been
        issued, so its slot may be refilled. The part must have been issued by `pump`."""
        if part not in self._pending:
            raise RuntimeError(
                f"part {part} acquired before it was fetched (not wanted, or its lane is stuck)"
            )
        _, slot = self._pending.pop(part)
        freed = self._release_held()
        self._held = slot
        return slot, freed

    def end_pass(self) -> int | None:
        """The last part's compute has been issued: its slot is free. Returns that slot (or None)."""
        return self._release_held()

    def issued(self, part: int) -> bool:
        return part in self._pending

    def free_held(self) -> int | None:
        """Before acquiring a part not issued yet: the slot of the part being computed is freed now (its
        compute has been issued), so that `pump` can fetch the part into it. What a one-slot lane walked
        alone needs (a UND-only pass: U_l+1 can only go into U_l's slot); the part is then fetched after U_l
        computes, as it is on a pass with GEN parts (there U_l's slot frees when G_l is acquired)."""
        return self._release_held()

    def _release_held(self) -> int | None:
        freed, self._held = self._held, None
        if freed is not None:
            self._free[self.slot_lane[freed]].append(freed)
        return freed
