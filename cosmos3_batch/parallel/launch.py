"""`cosmos3-torchrun`: torchrun itself (same flags), ending in the workers' exit code and one line.

Plain torchrun ends every failed job with exit 1 and a ~60-line `ChildFailedError` block, so a script (or
Slurm) cannot tell bad input (2) from a full disk (75) from a crash. The ranks of a job agree on their code
(parallel/exit_codes.py); here it passes through: one line saying what it means, and the code itself.
A rank that crashed is named with its error (its traceback is in the log above); a rank killed by a
signal gives 128 + the signal, as a shell would ("out of host memory" only when the cgroup's count of OOM
kills rose during the job). A stall is 69 (the survivors' code, and their line names the stalled rank): the
SIGKILL torchrun's agent sends afterwards to the stalled rank, which cannot answer SIGTERM, is not a cause.

On SIGINT / SIGTERM torchrun forwards the signal to its workers, which stop at the next pass, write what
is finished plus metrics.csv and summary.json, and exit 130 / 143; torchrun itself would then re-raise the
signal as a `SignalException` traceback.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

from cosmos3_batch.parallel.exit_codes import MEANING, ExitCode

STOP_CODES = {ExitCode.SIGINT: "SIGINT", ExitCode.SIGTERM: "SIGTERM"}
# torchrun SIGKILLs its workers this long after forwarding a stop (its default is 30 s): enough for the
# workers to write the outputs already decoded, metrics.csv and summary.json, even with 720p videos.
SHUTDOWN_TIMEOUT_S = "600"
# The agent's own lines per failure ("failed (exitcode: 2) local_rank: 0 ...", "Sending process ...
# closing signal SIGTERM"): our one line below says the same, once.
AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"
AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # what torchrun sends its workers when it stops them
AGENT_MARGIN_S = 5  # well under the 30 s the agent waits between its SIGTERM and its SIGKILL
NO_FILE = "<N/A>"  # ProcessFailure.error_file of a rank that wrote no error file (torchelastic's marker)


def _stopped(name: str) -> str:
    return (
        f"stopped by {name}; finished outputs, metrics.csv and summary.json are written. "
        "Rerun the same command to resume."
    )


def outcome(failures: dict, oom_killed: bool = False) -> tuple[int, str]:
    """(exit code, line) for torchrun's failures {global rank: ProcessFailure}. The first cause first: a rank
    killed by a signal the agent does not send (SIGKILL, SIGSEGV, SIGBUS: its peers then fail in their
    collectives), then a crash, then the code the ranks agreed on; the agent's own SIGTERMs never, nor the
    SIGKILL it sends a rank that outlived its SIGTERM after another rank had ended (a stalled one: it is
    captured after the agent's 30 s wait, so later than the exits that made the agent stop the job).
    `oom_killed`: the kernel's OOM killer ran in this job's cgroup (`oom_kills`)."""
    exits = [f.timestamp for f in failures.values() if f.exitcode > 0]
    first_exit = min(exits) if exits else None
    signalled = [(f.timestamp, rank, -f.exitcode) for rank, f in failures.items() if f.exitcode < 0]
    outlived = sorted(rank for t, rank, sig in signalled if sig == signal.SIGKILL and _after(t, first_exit))
    killed = sorted(e for e in signalled if e[2] not in AGENT_SIGNALS and e[1] not in outlived)
    if killed:
        _, rank, sig = killed[0]
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"signal {sig}"
        hint = " (the kernel's OOM killer ran in this job: out of host memory)" if oom_killed else ""
        return 128 + sig, f"rank {rank} was killed by {name}{hint}; rerun the same command to resume"
    crashed = sorted((rank, f) for rank, f in failures.items() if f.exitcode > 0 and f.error_file != NO_FILE)
    if crashed:  # an uncaught exception: torchelastic's `record` wrote its error file
        rank, failure = crashed[0]
        message = failure.message.get("message", "") if isinstance(failure.message, dict) else failure.message
        first = str(message).strip().splitlines()[0] if str(message).strip() else "no message"
        return ExitCode.FAILED, f"rank {rank} crashed: {first} (its traceback is above); exit 1"
    exited = sorted((f.timestamp, rank, f.exitcode) for rank, f in failures.items() if f.exitcode > 0)
    if exited:  # the ranks' agreed code; a rank that exited 0 is not among the failures
        code = exited[0][2]
        if code in STOP_CODES:
            return code, _stopped(STOP_CODES[code])
        ranks = ", ".join(str(rank) for rank in sorted(r for r, f in failures.items() if f.exitcode == code))
        meaning = MEANING.get(code, "see the log above")
        if code == ExitCode.PEER and outlived:
            stuck = ", ".join(map(str, outlived))
            meaning = (
                f"rank(s) {stuck} stalled (still running after SIGTERM, so the launcher SIGKILLed them): "
                "requeue the job, a rerun generates exactly the rest"
            )
        return code, f"the job exited with {code} (ranks {ranks}): {meaning}"
    rank, failure = min(failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    name = signal.Signals(-failure.exitcode).name
    return 128 - failure.exitcode, f"rank {rank} was stopped by {name}; rerun the same command to resume"


def _after(timestamp: int, first_exit: int | None) -> bool:
    """Captured clearly after the first exit: the agent SIGKILLs a rank 30 s after its SIGTERM, while a death
    that caused the exits is captured in the same round of polls (timestamps are whole seconds)."""
    return first_exit is not None and timestamp > first_exit + AGENT_MARGIN_S


def oom_kills(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Processes the OOM killer has killed in this process's memory cgroup, its descendants (the workers)
    included: cgroup v2 `memory.events`, v1 `memory.oom_control`; None where neither can be read. The
    launcher compares the count before and after the job: "out of memory" only when the kernel says so."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "memory":  # v1 (here, /sys/fs/cgroup/memory is its mount)
            found = _count(root / "memory" / path.lstrip("/") / "memory.oom_control")
        elif controllers == "":
            found = _count(root / path.lstrip("/") / "memory.events")
        else:
            continue
        if found is not None:
            return found
    return None


def _count(path: Path) -> int | None:
    try:
        pairs = [line.split() for line in path.read_text().splitlines()]
    except OSError:
        return None
    value = dict(pair for pair in pairs if len(pair) == 2).get("oom_kill", "")
    return int(value) if value.isdigit() else None


def main(argv: list[str] | None = None) -> None:
    import os

    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT_S)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    logging.getLogger(AGENT_LOGGER).setLevel(logging.CRITICAL)
    before = oom_kills()
    try:
        torchrun(argv)
    except SignalException as exc:  # the launcher got the signal (Ctrl-C, scancel, preemption)
        print(f"cosmos3-torchrun: {_stopped(signal.Signals(exc.sigval).name)}", file=sys.stderr)
        sys.exit(128 + int(exc.sigval))
    except ChildFailedError as exc:
        after = oom_kills()
        code, line = outcome(exc.failures, before is not None and after is not None and after > before)
        print(f"cosmos3-torchrun: {line}", file=sys.stderr)
        sys.exit(code)


if __name__ == "__main__":
    main()
