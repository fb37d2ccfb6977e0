"""What stops the job (DESIGN.md §14): SIGINT / SIGTERM, a full or read-only output filesystem, a checkpoint
file changed under the job. Every rank stops at the next pass, keeps what is finished, and exits with the
same code: 130 / 143 for the signals, the fault's own code otherwise.

The handler only records the signal; the pass loop reads it and sends it through the per-pass
all-reduce, so every rank leaves the loop at the same pass (no rank is left waiting in a collective).
Decoded outputs still get written; requests mid-denoise are abandoned and redone by the next run.

A second signal exits at once, unless it comes within `DUPLICATE_WINDOW_S` of the first: launchers
deliver one stop twice (Slurm signals every process of the step and torchrun forwards the same
signal to its workers a moment later), and that must not turn a clean stop into an abrupt one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

DUPLICATE_WINDOW_S = 1.0
SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass(frozen=True)
class JobFault:
    """A reason no request after it can succeed, found by one rank."""

    code: int  # the exit code every rank will return (parallel/exit_codes.py)
    kind: str  # "disk" | "checkpoint": which message and which precedence (PRECEDENCE)
    message: str  # one line for the user: what happened, where, and what to do


# When several ranks stop for different reasons, all report the first of these that any rank saw: a changed
# checkpoint (outputs may be wrong) before a full disk (free space) before a signal (the user asked).
PRECEDENCE = ("checkpoint", "disk", "signal")


class StopRequest:
    def __init__(self, quiet: bool | None = None) -> None:
        self.signum: int | None = None
        self.fault: JobFault | None = None  # set from any thread (the finisher's writes, the loop's checks)
        self._fault_lock = threading.Lock()  # never taken by the signal handler
        self._first_at = 0.0
        self._repeats = 0
        # Under torchrun every worker gets the signal: only rank 0 says so.
        self.quiet = os.environ.get("RANK", "0") != "0" if quiet is None else quiet

    @property
    def requested(self) -> bool:
        return self.signum is not None or self.fault is not None

    def fail(self, fault: JobFault) -> None:
        """Stop the job at the next pass for `fault`; the first fault of a kind wins, a worse kind replaces
        a milder one (PRECEDENCE)."""
        with self._fault_lock:  # the finisher (a full disk) and the loop (a changed checkpoint) may race
            current = self.fault
            if current is None or PRECEDENCE.index(fault.kind) < PRECEDENCE.index(current.kind):
                self.fault = fault

    def record(self) -> dict | None:
        """This rank's reason to stop, for the end-of-run exchange (None: it was not asked to)."""
        if self.fault is not None:
            return {"kind": self.fault.kind, "code": self.fault.code, "message": self.fault.message}
        if self.signum is not None:
            return {"kind": "signal", "code": self.exit_code, "message": self.name}
        return None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @property
    def exit_code(self) -> int:
        """The shell's convention for "ended by signal N": 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signum if self.signum is not None else 0

    def request(self, signum: int) -> None:
        """What the handler does; also the way tests and callers ask for a stop without a signal."""
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._first_at = signum, now
            self.quiet or _say(
                f"{signal.Signals(signum).name}: stopping after this pass; finished outputs are being "
                "written (send it again to exit at once)"
            )
        elif self._forwarded_duplicate():
            pass  # the launcher's copy of the signal we already act on
        elif now - self._first_at > DUPLICATE_WINDOW_S:
            _say(f"{signal.Signals(signum).name} again: exiting now; rerun the same command to resume")
            os._exit(128 + signum)

    def _forwarded_duplicate(self) -> bool:
        """Under torchrun (on Slurm the step's processes get the signal directly too) the first repeat may be
        torchrun's forwarded copy, however late it comes: it never turns the clean stop into an exit."""
        if self._repeats == 0 and "TORCHELASTIC_RUN_ID" in os.environ:
            self._repeats += 1
            return True
        return False

    def install(self) -> Callable[[], None]:
        """Handle SIGINT and SIGTERM in this process; returns a function that restores the old handlers.
        Signal handlers can only be set from the main thread: elsewhere (a test runner's thread) this
        does nothing and the caller keeps the default behaviour."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {sig: signal.signal(sig, lambda signum, _frame: self.request(signum)) for sig in SIGNALS}

        def restore() -> None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

        return restore


def _say(message: str) -> None:
    # os.write, not print or logging: a signal handler may run while another thread holds their locks.
    with contextlib.suppress(OSError):
        os.write(2, f"\n{message}\n".encode())
