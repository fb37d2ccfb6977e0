"""Killing a torchrun job as a preempted node would (SIGKILL to the launcher and every worker at once), at a
moment the test chose: `kill_if` freezes the job, looks at what it wrote, and kills it only if the moment
is still there, so a loaded machine cannot move the job on between the look and the kill."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (torchrun puts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def preempt(job: subprocess.Popen) -> None:
    """SIGKILL torchrun and all its workers at once, as a preempted Slurm node would."""
    _signal([job.pid, *descendants(job.pid)], signal.SIGKILL)
    job.wait()


def stopped(pid: int) -> bool:
    """Every thread of `pid` is stopped (or it is gone): SIGSTOP returns before the threads stop."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for task in tasks:
        try:
            state = Path(f"/proc/{pid}/task/{task}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("T", "t", "Z", "X"):
            return False
    return True


def kill_if(job: subprocess.Popen, still: Callable[[], object]) -> bool:
    """If `still()` is true, freeze torchrun and its workers, look again, and SIGKILL them all if it still is,
    else let them go on (returns whether it killed). Nothing moves between the last look and the kill."""
    if not still():  # the cheap look first: most polls end here, the job never stopped
        return False
    pids = [job.pid, *descendants(job.pid)]
    _signal(pids, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while not all(map(stopped, pids)):
        assert time.monotonic() < deadline, "the job's processes did not stop in 30 s"
        time.sleep(0.001)
    if still():
        _signal(pids, signal.SIGKILL)  # frozen: none has started a process since the scan
        job.wait()
        return True
    _signal(pids, signal.SIGCONT)
    return False
