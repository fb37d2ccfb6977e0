"""A peer that stalled or died (DESIGN.md §20): which rank did not come, where the job was, one line, exit 69.

A collective that times out (gloo's recv timeout, NCCL's watchdog) or loses its connection (a peer's closed
socket) reaches every surviving rank as a plain RuntimeError or a DistError, at slightly different moments:
each times out `--collective-timeout-s` after it began to wait. Every call into torch.distributed is wrapped
(engine/transport.py `collective_call`), so such an error arrives as a CollectiveFailed that knows how long
it waited: `peer_failure` tells a peer's failure from our own crash by that type, never by a message's
words. The exception names no rank. So the survivors meet once more, outside the broken process groups,
in the job's key-value store (torchrun's agent hosts it; the `run` of `tests/dist/jobs.py` lets rank 0 host
it): each checks in, waits up to `BOUND_S` (at most the timeout) for the others, and the ranks that never
checked in are the ones named. The first survivor to decide speaks for all (a compare-and-set in the
store): one line, no traceback. Nothing here runs per pass: the store is touched only after a collective
failed.

Where the job was comes from `Place`, which the pass loop keeps up to date for free: its trace already
notes every collective it is about to issue (pipeline/passes/runner.py PassSync.note).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from cosmos3_batch.engine.transport import CollectiveFailed

log = logging.getLogger("cosmos3_batch")

BOUND_S = 60.0  # the longest the survivors wait for each other after their own timeout fired
# The meeting waits in slices this long, so a SIGTERM during it is heard: the store's wait is one C++ call,
# and Python runs a signal handler only between calls. torchrun's agent SIGTERMs the survivors as soon as a
# rank has died, and SIGKILLs whoever has not left 30 s later.
MEET_SLICE_S = 0.25
STALLED, DIED = "stalled", "died"
REQUEUE = "finished outputs are written. Requeue the job: a rerun generates exactly the rest (exit 69)"
STALL_SHARE = 0.9  # of the stage's timeout: a collective that waited this long was waiting out a stall
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


def peer_failure(exc: BaseException, timeout_s: float | None = None) -> str | None:
    """STALLED or DIED when `exc` (or what it was raised from) is a collective a peer failed, else None.

    By what failed, never by the words of a message: one of our collective calls (CollectiveFailed, raised
    around every call into torch.distributed; a VAE group message's PeerLost) is a stall when it waited out
    the stage's `timeout_s` (a stalled peer makes it wait the group's timeout), else a death (a closed
    connection comes at once); torch's own DistNetworkError and DistStoreError (a process group's creation
    meeting a dead peer in the store) are a lost connection and its DistBackendError (NCCL's watchdog or an
    aborted communicator, met at a host read of a stream or wrapped by a call) a peer that never came.
    Anything else, whatever its text, is a crash of this rank's own."""
    chain = []
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__
    for seen in chain:  # torch's own types first: a CollectiveFailed may wrap one
        if isinstance(seen, dist.DistNetworkError | dist.DistStoreError):  # a lost connection, the store's
            return DIED
        if isinstance(seen, dist.DistBackendError):
            return STALLED
    for seen in chain:
        if isinstance(seen, CollectiveFailed):
            stalled = timeout_s is not None and seen.waited_s >= STALL_SHARE * timeout_s
            return STALLED if stalled else DIED
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


def post_mortem(
    rank: int,
    world_size: int,
    kind: str,
    place: Place,
    bound_s: float | None = None,
    stopping: Callable[[], bool] = lambda: False,
) -> Verdict:
    """After a collective failed on this rank: meet the other survivors in the job's store, name the ranks
    that did not come, and decide who says so. Bounded: at most `bound_s` (default min(timeout, BOUND_S)),
    and cut short once `stopping()` (a SIGTERM or SIGINT came: the launcher is ending the job, and a rank
    that died never checks in, so waiting out the bound would only end in the launcher's SIGKILL)."""
    bound = min(place.timeout_s, BOUND_S) if bound_s is None else bound_s
    where = place.describe()
    try:
        missing, speaker, kind = _meet(rank, world_size, kind, bound, stopping)
    except Exception as exc:  # the store's host (rank 0, when the agent does not host it) is the one stuck
        log.debug("the job's store did not answer: %s", exc)
        missing, speaker = None, True
    return Verdict(missing, speaker, describe(kind, missing, where, place))


def _meet(
    rank: int, world_size: int, kind: str, bound_s: float, stopping: Callable[[], bool]
) -> tuple[list[int], bool, str]:
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
    deadline = time.monotonic() + bound_s
    while not stopping() and (left := deadline - time.monotonic()) > 0:
        with contextlib.suppress(Exception):  # not everyone yet: which ranks came is read below
            store.wait(keys, timedelta(seconds=min(MEET_SLICE_S, left)))
            break
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
