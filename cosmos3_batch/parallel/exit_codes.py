"""The exit codes of `run` (docs/running.md has the table), shared by the ranks and the launcher.

Every rank of a job exits with the same code, so a script (or Slurm) can tell bad input from a full disk
from a crash: only a crash or a peer's death gives a rank a code of its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
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
