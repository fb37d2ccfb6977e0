"""What a thread of this rank is blocked on, for rank 0's live warning (passes/monitor.py, DESIGN.md §20).

A wait that a stalled peer can make endless (the per-pass exchange, the compute thread's wait for a layer
part whose gather runs on the fetch worker, an `--sp` all-to-all or agreement, a VAE group message) is
bracketed by `with mark.waiting(what, who):`. That writes one tuple (an episode number, a monotonic
timestamp, a label prepared by the caller, the awaited rank when the caller knows it) and clears it on the
way out: no collective, no formatting, no lock (one attribute assignment is atomic in CPython). The
monitor thread reads `state` and warns once per episode that passed its share of the timeout.

One mark per thread that waits (the pass loop's; the finisher's for group decodes): a thread is in one
wait at a time, so a mark never needs more than one slot.
"""

from __future__ import annotations

import time
from typing import NamedTuple


class Wait(NamedTuple):
    episode: int  # distinct for every wait: the monitor says each one at most once
    since: float  # time.monotonic() when the wait began
    what: str  # what it waits for: "the per-pass exchange", "the gather of layer 3's GEN part", ...
    who: str | None  # the awaited rank(s) where the waiting side knows ("rank 1"); None: the monitor says


class WaitMark:
    def __init__(self, name: str = "the pass loop") -> None:
        self.name = name  # the waiting thread, for a debugger: not in the warning
        self.state: Wait | None = None
        self._episodes = 0
        self._outer: list[Wait | None] = []  # the waits this one is inside of, innermost last

    def waiting(self, what: str, who: str | None = None) -> WaitMark:
        """Mark the wait begun now; use as `with mark.waiting(...):` so that it ends however the wait ends.
        Waits nest (a group's agreement inside a host read, a message inside a decode): the inner one's end
        gives the outer one back."""
        self._episodes += 1
        self._outer.append(self.state)
        self.state = Wait(self._episodes, time.monotonic(), what, who)
        return self

    def __enter__(self) -> WaitMark:
        return self

    def __exit__(self, *exc) -> None:
        self.state = self._outer.pop() if self._outer else None


def peers(size: int) -> str | None:
    """The others of rank 0's group of `size` ranks (ranks 0..size-1: rank 0's groups start at global rank 0),
    as a warning names them: one peer is known; of more, which one is late is not."""
    if size == 2:
        return "rank 1"
    return f"one or more of ranks 1-{size - 1}" if size > 2 else None
