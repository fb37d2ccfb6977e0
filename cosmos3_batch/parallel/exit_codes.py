"""The exit codes of `run` (docs/running.md has the table), shared by the ranks and the launcher.

Every rank of a job exits with the same code, so a script (or Slurm) can tell bad input from a full disk
from a crash: only a crash or a peer's death gives a rank a code of its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0  # every request ok
    FAILED = 1  # some requests failed (listed in summary.json and metrics.csv), or the checkpoint changed
    BAD_INPUT = 2  # bad requests, flags or checkpoint, found before any weight was loaded
    PEER = 69  # EX_UNAVAILABLE: a peer rank stalled past --collective-timeout-s (or died); requeue the job
    DISK = 75  # EX_TEMPFAIL: the output filesystem is full or read-only; free space and rerun
    SIGINT = 128 + signal.SIGINT  # stopped by Ctrl-C after writing what was finished; rerun to resume
    SIGTERM = 128 + signal.SIGTERM  # stopped by SIGTERM (scancel, preemption); rerun to resume


MEANING = {
    ExitCode.OK: "every request ok",
    ExitCode.FAILED: "some requests failed, or the checkpoint changed (see the error above)",
    ExitCode.BAD_INPUT: "bad input or configuration, nothing was generated",
    ExitCode.PEER: "a peer rank stalled or died (see the error above): requeue the job, a rerun generates "
    "exactly the rest",
    ExitCode.DISK: "the output filesystem is full or read-only: free space and rerun",
    ExitCode.SIGINT: "stopped by SIGINT; rerun to resume",
    ExitCode.SIGTERM: "stopped by SIGTERM; rerun to resume",
}


def leave_now(code: int) -> None:
    """Exit with `code` now, without the interpreter's finalization.

    Under torchrun the first rank to exit non-zero makes the agent SIGTERM the others. Finalization (torch,
    gloo/NCCL threads) takes a while and runs with the default SIGTERM action restored, so a peer still
    in it would die of the signal (-15) and the launcher would see two outcomes for one job. The job's
    files are fsynced and closed by now; only the standard streams need a flush."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def exit_as_one(code: int) -> None:
    """From here on, a SIGTERM or SIGINT exits at once with `code` (the job is done and every rank agreed on
    `code`): the gap between the end of the job and `leave_now`, the teardown of the process groups."""

    def leave(_signum, _frame) -> None:
        leave_now(code)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, leave)


# How long a rank other than 0 waits for rank 0 to print a configuration error that every rank found.
RANK_0_GRACE_S = 15.0


def after_rank_0(message: str, grace_s: float = RANK_0_GRACE_S) -> str:
    """The line a configuration error found before the ranks have met (a flag, --model, the device) is said
    with, once for the job. Every rank usually finds the same one at once: rank 0 says it at once (as does
    a world of one). Another rank waits up to `grace_s` first: rank 0 says it and leaves, and torchrun's
    agent then SIGTERMs this rank, which exits 2 at once without a word. Were it to exit first, the agent
    would SIGTERM rank 0 before it printed (the message was lost). A rank still here after `grace_s` found
    a problem of its own (rank 0 went on to wait for it): it says it, naming itself."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if rank == 0 or world == 1:
        return message
    exit_as_one(ExitCode.BAD_INPUT)
    time.sleep(grace_s)
    return f"rank {rank}: {message}"
