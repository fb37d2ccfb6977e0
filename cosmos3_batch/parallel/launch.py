"""`cosmos3-torchrun`: torchrun itself (same flags), with a clean end when the job is stopped by a signal.

On SIGINT / SIGTERM torchrun forwards the signal to its workers, which stop at the next pass, write what
is finished plus metrics.csv and summary.json, and exit 130 / 143. torchrun then re-raises the signal as a
`SignalException` traceback and exits 1; here that becomes one line and the shell's exit code for the
signal, so `Ctrl-C` and a Slurm preemption read the same through the launcher as without it.
"""

from __future__ import annotations

import signal
import sys

STOP_CODES = {128 + signal.SIGINT: "SIGINT", 128 + signal.SIGTERM: "SIGTERM"}


def _stopped(name: str, code: int) -> None:
    print(
        f"cosmos3-torchrun: stopped by {name}; finished outputs, metrics.csv and summary.json are written. "
        "Rerun the same command to resume.",
        file=sys.stderr,
    )
    sys.exit(code)


# torchrun SIGKILLs its workers this long after forwarding a stop (its default is 30 s): enough for the
# workers to write the outputs already decoded, metrics.csv and summary.json, even with 720p videos.
SHUTDOWN_TIMEOUT_S = "600"


def main(argv: list[str] | None = None) -> None:
    import os

    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT_S)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SignalException as exc:  # the launcher got the signal (Ctrl-C, scancel, preemption)
        _stopped(signal.Signals(exc.sigval).name, 128 + int(exc.sigval))
    except ChildFailedError as exc:
        codes = {failure.exitcode for failure in exc.failures.values()}
        if len(codes) == 1 and (code := codes.pop()) in STOP_CODES:  # only the workers were signalled
            _stopped(STOP_CODES[code], code)
        raise


if __name__ == "__main__":
    main()
