"""A peer that stalled or died (DESIGN.md §20): which rank did not come, where the job was, one line, exit 69.

A collective that times out (gloo: "Timed out waiting 30000ms for recv operation", NCCL's watchdog) or
loses its connection ("Connection closed by peer") reaches every surviving rank as a plain RuntimeError,
at slightly different moments: each times out `--collective-timeout-s` after it began to wait. The
exception names no rank. So the survivors meet once more, outside the broken process groups, in the job's
key-value store (torchrun's agent hosts it; the `run` of `tests/dist/jobs.py` lets rank 0 host it): each
checks in, waits up to `BOUND_S` (at most the timeout) for the others, and the ranks that never checked
in are the ones named. The first survivor to decide speaks for all (a compare-and-set in the store): one
line, no traceback. Nothing here runs per pass: the store is touched only after a collective failed.

Where the job was comes from `Place`, which the pass loop keeps up to date for free: its trace already
notes every collective it is about to issue (pipeline/passes/runner.py PassSync.note).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger("cosmos3_batch")

BOUND_S = 60.0  # the longest the survivors wait for each other after their own timeout fired
STALLED, DIED = "stalled", "died"
REQUEUE = "finished outputs are written. Requeue the job: a rerun generates exactly the rest (exit 69)"
# How gloo and NCCL say it (lower case); a message with none of these is a crash of our own, not a peer.
_MARKERS = {
    STALLED: ("timed out", "timeout", "monitoredbarrier"),
    DIED: ("connection closed", "connection reset", "broken pipe", "remote process exited", "aborted"),
}
# The trace's event prefixes (pipeline/passes/runner.py, parallel/seq_group.py, parallel/vae_group.py).
_PHASES = {
    "all_reduce": "the per-pass exchange",
    "all_to_all": "an --sp all-to-all",
    "max": "an --sp agreement",
    "share": "an --sp group's shared step-cache distances",
    "agree": "an --sp agreement",
    "broadcast": "a VAE group exchange (encode)",
    "read": "a host read of the device",  # `read:<what>`: the host blocks on a stream (PassSync.host_read)
}


def peer_failure(exc: BaseException) -> str | None:
    """STALLED or DIED when `exc` (or what it was raised from) is a collective a peer failed, else None."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, dist.DistBackendError | dist.DistNetworkError):
            # The backend's own error (NCCL's watchdog, an aborted communicator, the store's connection): a
            # peer's by its type, wherever the host met it (a collective, or a read of a stream it stalled).
            text = str(seen).lower()
            return STALLED if any(marker in text for marker in _MARKERS[STALLED]) else DIED
        if isinstance(seen, RuntimeError):
            text = str(seen).lower()
            for kind, markers in _MARKERS.items():
                if any(marker in text for marker in markers):
                    return kind
        seen = seen.__cause__
    return None


@dataclass
class Place:
    """Where this rank is: the stage of the job, and in the pass loop the pass and its last collective."""

    stage: str = "start-up"
    timeout_s: float = 600.0  # the timeout of the stage's collectives (--load-timeout-s while loading)
    timeout_flag: str = "--collective-timeout-s"
    passes: int = 0  # per-pass exchanges issued so far (exchange k opens pass k - 1, counted from 0)
    event: str = ""  # the last collective noted in the pass trace
    vae: bool = False  # a VAE group walk broke (pipeline/finish/vae_team.py): a decode's or encode's messages

    def enter(self, stage: str, timeout_s: float | None = None, flag: str | None = None) -> None:
        self.stage = stage
        self.timeout_s = self.timeout_s if timeout_s is None else timeout_s
        self.timeout_flag = self.timeout_flag if flag is None else flag

    def note(self, event: str) -> None:
        self.event = event
        if event.startswith("all_reduce"):
            self.passes += 1

    def describe(self) -> str:
        number = max(self.passes - 1, 0)
        if self.vae:
            return f"pass {number}, a VAE group exchange"
        if self.stage != "passes" or not self.event:
            return self.stage
        return f"pass {number}, {phase(self.event)}"


def phase(event: str) -> str:
    """A trace event (`all_reduce:11`, `part:3.gen`, `all_to_all:...`) as the line and the warning say it."""
    head = event.split(":", 1)[0]
    if head == "read":
        return f"{_PHASES[head]} ({event.split(':', 1)[1]})"
    if head != "part":
        return _PHASES.get(head, head)
    layer, part = event.split(":", 1)[1].split(".")
    what = f"the gather of layer {layer}'s {part.upper()} part"
    return what + (" (a prefill pass)" if part.lower() == "und" else "")


@dataclass(frozen=True)
class Verdict:
    missing: list[int] | None  # the ranks that did not check in; None: the store did not answer either
    speaker: bool  # this rank prints the line
    line: str


def post_mortem(rank: int, world_size: int, kind: str, place: Place, bound_s: float | None = None) -> Verdict:
    """After a collective failed on this rank: meet the other survivors in the job's store, name the ranks
    that did not come, and decide who says so. Bounded: at most `bound_s` (default min(timeout, BOUND_S))."""
    bound = min(place.timeout_s, BOUND_S) if bound_s is None else bound_s
    where = place.describe()
    try:
        missing, speaker, kind = _meet(rank, world_size, kind, bound)
    except Exception as exc:  # the store's host (rank 0, when the agent does not host it) is the one stuck
        log.debug("the job's store did not answer: %s", exc)
        missing, speaker = None, True
    return Verdict(missing, speaker, describe(kind, missing, where, place))


def _meet(rank: int, world_size: int, kind: str, bound_s: float) -> tuple[list[int], bool, str]:
    """(the ranks that never came, whether this rank speaks, the job's kind of failure). A survivor whose
    collective broke because another survivor had already left sees a death; if any survivor timed out
    waiting, the rank that never came stalled."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=timedelta(seconds=bound_s),
    )  # fmt: skip
    prefix = f"cosmos3_batch/peer/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    keys = [f"{prefix}/here/{r}" for r in range(world_size)]
    store.set(keys[rank], kind)
    with contextlib.suppress(Exception):  # somebody did not come: which ones is read below
        store.wait(keys, timedelta(seconds=bound_s))
    missing = [r for r, key in enumerate(keys) if not store.check([key])]
    kinds = {store.get(key).decode() for r, key in enumerate(keys) if r not in missing}
    first = store.compare_set(f"{prefix}/speaker", "", str(rank))
    speaker = (first.decode() if isinstance(first, bytes) else first) == str(rank)
    return missing, speaker, STALLED if STALLED in kinds else kind


def describe(kind: str, missing: list[int] | None, where: str, place: Place) -> str:
    if missing == []:  # everyone came: one rank was slower than the timeout, and then the others gave up
        limit = f"{place.timeout_flag} {place.timeout_s:g}"
        return f"a collective at {where} waited past {limit} (every rank came later: one was slow); {REQUEUE}"
    if missing is None:
        who = "a peer rank (which one is unknown: the job's store did not answer either, so rank 0 is likely)"
    else:
        who = ("rank " if len(missing) == 1 else "ranks ") + ", ".join(map(str, missing))
    if kind == STALLED:
        limit = f"{place.timeout_flag} {place.timeout_s:g}"
        what = f"{who} did not arrive within {limit} at {where} (stalled: a hung GPU, a frozen filesystem?)"
    else:
        what = f"{who} left the job at {where} (its process died: the launcher names the signal)"
    return f"{what}; {REQUEUE}"
